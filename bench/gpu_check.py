"""`make gpu-check`: the paths only a GPU can exercise, in one short run.

Nothing in `make test` needs a GPU; this script is what to run wherever one
is at hand (and what docs/benchmarks.md records).  Each check prints one
`PASS|FAIL|SKIP <name>: <figures>` line; the exit status is 0 when nothing
failed, 77 when there is no GPU at all (nothing was checked), 1 otherwise.

Checks, in order (about 2-4 minutes on one GPU):

cuda        torch sees the GPUs; NCCL version.
nvml        our NVML telemetry (tp_supervise.watchdogs.gpu) samples every
            GPU: utilisation, memory, processes; time per sample.
serve       the built-in engine with ``--device cuda`` (NCCL all-reduces)
            under ``supervise serve``: ready, one completion, the GPU
            metrics on /metrics, Ctrl-C -> exit 0, then the ranks' GPU memory
            is released (NVML lists none of their pids; used memory back to
            the baseline within a tolerance).
hang        the same engine with ``--inject hang_collective@1:3`` and a hard
            timeout: exit 81 naming rank 1, a bundle, GPU memory released.
abort       ``--inject abort@1:3`` (native abort in a rank while its peer
            sits in an NCCL all-reduce): exit 80, GPU memory released.
survivor    exit 85: a run process that holds GPU memory and cannot be
            killed (its cgroup-v1 freezer is FROZEN, so SIGKILL stays
            pending) is reported as a survivor holding GPU memory; skipped
            where no v1 freezer can be mounted.

With one GPU the engine runs at TP=1 (the NCCL communicator still forms;
collectives are trivially local); with two or more, TP=2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file (bench/gpu_check.py): the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._docs import Stamp, add_common_args, replace_section  # noqa: E402

HEADING = "## GPU check (`make gpu-check`, bench/gpu_check.py)"
MODULE = "bench.gpu_check"
SUPERVISE = [str(Path(sys.executable).with_name("supervise"))]
SKIPPED = 77
DEVICE = "cuda"  # --dry-run-cpu: "cpu", and every NVML figure is left out
MEM_TOLERANCE = 256 << 20  # bytes of GPU memory allowed to differ from the baseline after a run


@dataclass
class Result:
    name: str
    status: str  # PASS FAIL SKIP
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


@dataclass
class Supervised:
    """One `supervise serve` run: its process, its JSON log lines, where it listens."""

    proc: subprocess.Popen
    log_path: Path
    metrics: str
    api: str
    started: float = field(default_factory=time.monotonic)

    def lines(self) -> list[dict]:
        out = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        return out

    def events(self, text: str) -> list[dict]:
        slug = text.replace(" ", "_")
        return [e for e in self.lines() if text in (e.get("message"), e.get("event")) or e.get("event") == slug]

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            if self.wait(20) is None:
                self.proc.kill()
                self.proc.wait(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def nvml_used() -> dict[int, int]:
    """Used bytes per GPU, straight from NVML (not through our code: an independent view)."""
    if DEVICE != "cuda":
        return {}
    import pynvml

    pynvml.nvmlInit()
    try:
        return {i: pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used
                for i in range(pynvml.nvmlDeviceGetCount())}
    finally:
        pynvml.nvmlShutdown()


def nvml_holders(pids: set[int]) -> list[tuple[int, int]]:
    if DEVICE != "cuda":
        return []
    import pynvml

    pynvml.nvmlInit()
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in pids:
                    found.append((i, p.pid))
        return found
    finally:
        pynvml.nvmlShutdown()


def released(pids: set[int], baseline: dict[int, int], wait_s: float = 15.0) -> tuple[bool, str]:
    """After a run: no rank pid on any GPU, used memory back near the baseline."""
    deadline = time.monotonic() + wait_s
    while True:
        holders = nvml_holders(pids)
        used = nvml_used()
        over = {i: used[i] - baseline.get(i, 0) for i in used if used[i] - baseline.get(i, 0) > MEM_TOLERANCE}
        if (not holders and not over) or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    detail = f"holders={holders} over_baseline_MiB={ {i: b >> 20 for i, b in over.items()} }"
    return not holders and not over, detail


def rank_pids(run: Supervised) -> set[int]:
    return {int(e["pid"]) for e in run.events("rank started") if "pid" in e}


def start(tmp: Path, name: str, nproc: int, extra: list[str], engine: bool = True) -> Supervised:
    """`supervise serve` of the built-in engine on CUDA (or, engine=False, of the command in extra)."""
    mport, aport = free_port(), free_port()
    log_path = tmp / f"{name}.log"
    own = ["--device", DEVICE, "--port", str(aport)] if engine else []
    argv = [*SUPERVISE, "serve", "--nproc-per-node", str(nproc), *own,
            "--metrics-addr", f"127.0.0.1:{mport}", "--metrics-linger", "0",
            "--dump-dir", str(tmp / f"{name}-dumps"), "--log-format", "json", *extra]
    out = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    out.close()
    return Supervised(proc, log_path, f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{aport}")


def wait_ready(run: Supervised, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            return False
        if http(run.metrics + "/readyz", timeout=2)[0] == 200:
            return True
        time.sleep(0.5)
    return False


def complete(run: Supervised) -> tuple[int, str]:
    return http(run.api + "/v1/completions", {"prompt": "The GPU check says", "max_tokens": 16, "temperature": 0})


def bundles(tmp: Path, name: str) -> list[dict]:
    found = []
    for summary in sorted((tmp / f"{name}-dumps").glob("*/summary.json")):
        try:
            found.append(json.loads(summary.read_text()))
        except ValueError:
            continue
    return found


def check_cuda() -> Result:
    import torch

    if not torch.cuda.is_available():
        return Result("cuda", "SKIP", "torch.cuda.is_available() is False")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return Result("cuda", "PASS", f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {len(names)} GPU(s): {names}")


def check_nvml() -> Result:
    from tp_supervise.watchdogs.gpu import GpuTelemetry

    tel = GpuTelemetry()
    try:
        t0 = time.perf_counter()
        samples = tel.sample()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(20):
            tel.sample()
        per = (time.perf_counter() - t0) / 20
    finally:
        tel.close()
    if not samples:
        return Result("nvml", "FAIL", "GpuTelemetry().sample() returned nothing on a GPU host")
    shown = [s.to_dict() for s in samples]
    return Result("nvml", "PASS", f"{len(samples)} GPU(s), first sample {first * 1e3:.1f} ms, then {per * 1e3:.2f} ms each; {shown}")


def check_serve(tmp: Path, nproc: int) -> Result:
    baseline = nvml_used()
    run = start(tmp, "serve", nproc, [])
    try:
        if not wait_ready(run, 600):
            return Result("serve", "FAIL", f"not ready (exit {run.proc.poll()}); log {run.log_path}")
        ready_s = time.monotonic() - run.started
        status, body = complete(run)
        if status != 200:
            return Result("serve", "FAIL", f"completion answered {status}: {body[:300]}")
        metrics = http(run.metrics + "/metrics")[1]
        gpu_lines = [ln for ln in metrics.splitlines() if ln.startswith("supervise_gpu_")]
        pids = rank_pids(run)
        during = nvml_holders(pids)
        run.proc.send_signal(signal.SIGINT)
        code = run.wait(60)
        ok, rel = released(pids, baseline)
        detail = (f"ready {ready_s:.1f} s, completion 200 ({json.loads(body)['choices'][0]['text']!r}), "
                  f"{len(gpu_lines)} supervise_gpu_* samples, ranks {sorted(pids)} on GPUs {during}, "
                  f"exit {code}, released: {rel}")
        on_gpu = DEVICE != "cuda" or (bool(gpu_lines) and bool(during))
        good = code == 0 and on_gpu and ok
        return Result("serve", "PASS" if good else "FAIL", detail)
    finally:
        run.kill()


def check_fault(tmp: Path, nproc: int, name: str, inject: str, expect: int, reason: str, extra: list[str]) -> Result:
    if nproc < 2:
        return Result(name, "SKIP", "needs two GPUs (a rank that faults while its peer waits in NCCL)")
    baseline = nvml_used()
    run = start(tmp, name, nproc, ["--inject", inject, *extra])
    try:
        if not wait_ready(run, 600):
            return Result(name, "FAIL", f"not ready (exit {run.proc.poll()}); log {run.log_path}")
        pids = rank_pids(run)
        t0 = time.monotonic()
        for _ in range(6):  # the injection fires at decode step 3
            if run.proc.poll() is not None:
                break
            complete(run)
        code = run.wait(120)
        took = time.monotonic() - t0
        ok, rel = released(pids, baseline)
        found = bundles(tmp, name)
        culprits = [(b.get("reason"), b.get("culprit_ranks")) for b in found]
        named = (reason, [1]) in culprits
        good = code == expect and named and ok
        return Result(name, "PASS" if good else "FAIL",
                      f"exit {code} (want {expect}) {took:.1f} s after the first request, bundles {len(found)} "
                      f"(reason, culprits) {culprits}, released: {rel}")
    finally:
        run.kill()


SURVIVOR_RANK = textwrap.dedent(
    """
    import os, sys, time, torch
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB held
    torch.cuda.synchronize()
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(3600)
    """
)


def v1_freezer(tmp: Path) -> Path | None:
    """A cgroup-v1 freezer hierarchy mounted under tmp, or None where the host does not allow one."""
    root = tmp / "freezer"
    root.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "cgroup", "-o", "freezer", "none", str(root)],
                      capture_output=True).returncode != 0:
        return None
    return root


def check_survivor(tmp: Path) -> Result:
    """A rank holds GPU memory and is frozen (SIGKILL pending): teardown must say 85 and name it."""
    freezer = v1_freezer(tmp)
    if freezer is None:
        return Result("survivor", "SKIP", "no cgroup-v1 freezer can be mounted here (needs root and a v1 freezer controller)")
    group = freezer / "tp-supervise-gpu-check"
    group.mkdir(exist_ok=True)
    script, pidfile = tmp / "holder.py", tmp / "holder.pid"
    script.write_text(SURVIVOR_RANK)
    run = start(tmp, "survivor", 1, ["--no-hook", "--startup-timeout", "3600", "--kill-grace", "1", "--",
                                     sys.executable, str(script), str(pidfile)], engine=False)
    pid = None
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.2)
        if not pidfile.exists():
            return Result("survivor", "FAIL", f"the holder never allocated (exit {run.proc.poll()}); log {run.log_path}")
        pid = int(pidfile.read_text())
        (group / "tasks").write_text(str(pid))
        (group / "freezer.state").write_text("FROZEN")
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(120)
        holders = [e for e in run.lines() if "gpu" in json.dumps(e).lower() and "surviv" in json.dumps(e).lower()]
        good = code == 85
        return Result("survivor", "PASS" if good else "FAIL",
                      f"exit {code} (want 85), survivor log lines: {[e.get('message') or e.get('event') for e in holders][:3]}")
    finally:
        try:
            (group / "freezer.state").write_text("THAWED")
        except OSError:
            pass
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.kill()
        time.sleep(0.5)
        try:
            group.rmdir()
        except OSError:
            pass
        subprocess.run(["umount", str(freezer)], capture_output=True)


def section(stamp: Stamp, results: list[Result], dry_run: bool) -> str:
    if dry_run:
        what = ("**No GPU on this machine**: this is `--dry-run-cpu`, the script's own plumbing on CPU (gloo, "
                "no NVML): the CUDA, NCCL and NVML paths did not run. Record a run on a GPU host here with "
                "`make gpu-check ARGS=--update-docs`.")
    else:
        what = "On a GPU host:"
    lines = "\n".join(f"    {r.line()}" for r in results)
    return f"""{HEADING}

{stamp.text()}

What only a GPU exercises, in one short script: the built-in engine with `--device cuda` (NCCL) under
`supervise serve` (ready, a completion, `supervise_gpu_*` on /metrics, Ctrl-C -> 0, then NVML lists none of
the ranks' pids and used memory is back at the baseline), a hang (`--inject hang_collective@1:3`: 81,
culprit [1], memory released), a native abort while the peer sits in an NCCL all-reduce (80, memory
released), and exit 85 with a frozen (cgroup-v1 freezer) rank holding 64 MiB of GPU memory. Each check
prints `PASS|FAIL|SKIP name: figures`; exit 77 where no GPU exists.

{what}

{lines}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, bundles)")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run the serve/hang/abort checks on CPU (gloo) without NVML: proves the script's own plumbing on a host without a GPU")
    add_common_args(ap, "only the cuda, nvml and serve checks")
    args = ap.parse_args(argv)
    if args.quick and not args.only:
        args.only = "cuda,nvml,serve"
    stamp = Stamp.begin(MODULE, argv)
    only = set(filter(None, args.only.split(",")))

    try:
        import torch
    except ImportError:
        print("SKIP all: torch is not installed")
        return SKIPPED
    global DEVICE
    if args.dry_run_cpu:
        DEVICE, nproc = "cpu", 2
    elif not torch.cuda.is_available():
        print("SKIP all: no CUDA GPU on this host (torch.cuda.is_available() is False)")
        return SKIPPED
    else:
        nproc = min(2, torch.cuda.device_count())

    tmp = Path(tempfile.mkdtemp(prefix="tp-supervise-gpu-check-"))
    checks = [
        *([("cuda", check_cuda), ("nvml", check_nvml)] if DEVICE == "cuda" else []),
        ("serve", lambda: check_serve(tmp, nproc)),
        ("hang", lambda: check_fault(tmp, nproc, "hang", "hang_collective@1:3", 81, "hang", ["--hard-timeout", "15", "--soft-timeout", "5"])),
        ("abort", lambda: check_fault(tmp, nproc, "abort", "abort@1:3", 80, "rank_exit", [])),
        *([("survivor", lambda: check_survivor(tmp))] if DEVICE == "cuda" else []),
    ]
    results = []
    for name, fn in checks:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception as exc:  # a check that breaks is a failure with its reason, and the others still run
            res = Result(name, "FAIL", f"{type(exc).__name__}: {exc}")
        res.detail += f" [{time.monotonic() - t0:.1f} s]"
        print(res.line(), flush=True)
        results.append(res)
    print(f"scratch: {tmp}" if args.keep else "", end="\n" if args.keep else "")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.update_docs:
        text = section(stamp, results, args.dry_run_cpu)
        print(text)
        replace_section(args.update_docs, HEADING, text)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
