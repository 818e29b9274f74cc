"""The control plane's slots, written by the engine adapter's wrappers in the process that runs vLLM's scheduler
or front end: a real control segment, read back as the supervisor reads it.  The classes wrapped here have the
names and signatures of vLLM 0.32's (``OutputProcessor``, ``EngineCoreProc``, ``Scheduler``); real vLLM runs
these seams in tests/engines (make test-engines)."""

from __future__ import annotations

import types

import pytest

from tp_supervise.supervisor.rank import engines, runtime
from tp_supervise.supervisor.rank import heartbeat as hb


@pytest.fixture
def control(tmp_path, monkeypatch):
    segment = hb.HeartbeatSegment(tmp_path / "control", hb.CONTROL_SLOTS, "run-1", 0.0)
    monkeypatch.setenv(runtime.ENV_CONTROL, str(segment.path))
    for name in (runtime.ENV_SUPERVISOR_PID, runtime.ENV_DEATH_FD):
        monkeypatch.delenv(name, raising=False)
    runtime.state.control = {}
    yield segment
    runtime.state.control = {}
    segment.close()


def patched(module_name: str, **classes) -> types.ModuleType:
    module = types.ModuleType(module_name)
    for name, cls in classes.items():
        setattr(module, name, cls)
    engines.patcher(lambda _label, fn: fn)(module)
    return module


class OutputProcessor:
    def __init__(self):
        self.request_states: dict[str, int] = {}

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):
        self.request_states[request] = 0

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None):
        for request, finished in engine_core_outputs:
            if finished:
                self.request_states.pop(request)

    def abort_requests(self, request_ids, internal):
        for request in request_ids:
            self.request_states.pop(request, None)
        return list(request_ids)


def front(segment) -> hb.SlotSnapshot:
    return segment.read(hb.control_slot(hb.ROLE_FRONTEND))


def test_front_end_is_inside_a_step_while_requests_wait_and_each_output_batch_is_progress(control):
    patched("vllm.v1.engine.output_processor", OutputProcessor=OutputProcessor)
    proc = OutputProcessor()
    assert not front(control).claimed  # claimed at its first request, not at import
    proc.add_request("a", "hello")
    slot = front(control)
    assert slot.claimed and slot.role_name == "frontend" and slot.in_step and slot.step == 0 and slot.rank == -1
    proc.add_request("b", "hi")
    proc.process_outputs([("a", False)])  # a batch of outputs: progress, still in flight
    assert (front(control).step, front(control).in_step) == (1, True)
    proc.process_outputs([("a", True), ("b", True)])  # all finished
    assert (front(control).step, front(control).in_step) == (2, False)


def test_front_end_whose_requests_are_all_aborted_shows_no_progress(control):
    """Clients that time out are not the engine making progress: a stopped scheduler stays a stall."""
    patched("vllm.v1.engine.output_processor", OutputProcessor=OutputProcessor)
    proc = OutputProcessor()
    proc.add_request("a", "hello")
    proc.abort_requests(["a"], internal=False)
    slot = front(control)
    assert (slot.step, slot.in_step) == (0, False)


class Scheduler:
    def __init__(self, tokens):
        self.tokens = tokens

    def schedule(self, throttle_prefills=False):
        return types.SimpleNamespace(total_num_scheduled_tokens=self.tokens)


class EngineCoreProc:
    def __init__(self, scheduler, seen):
        self.scheduler, self.seen = scheduler, seen

    def _process_input_queue(self):
        return None

    def _process_engine_step(self):
        self.scheduler.schedule()
        slot = self.seen.read(hb.control_slot(hb.ROLE_SCHEDULER))
        self.inside = (slot.in_step, slot.phase, slot.step_tokens)
        return True


def test_scheduler_step_carries_its_phase_and_shape(control):
    patched("vllm.v1.core.sched.scheduler", Scheduler=Scheduler)
    patched("vllm.v1.engine.core", EngineCoreProc=EngineCoreProc)
    core = EngineCoreProc(Scheduler(tokens=512), control)
    core._process_input_queue()
    slot = control.read(hb.control_slot(hb.ROLE_SCHEDULER))
    assert slot.role_name == "scheduler" and slot.phase == "idle" and not slot.in_step
    assert core._process_engine_step() is True
    assert core.inside == (True, "execute", 512)
    slot = control.read(hb.control_slot(hb.ROLE_SCHEDULER))
    assert (slot.step, slot.in_step, slot.last_step_tokens) == (1, False, 512)


def test_a_second_process_does_not_take_a_live_holders_slot(control, tmp_path):
    """A data-parallel engine runs several engine cores: the first keeps the scheduler's slot."""
    writer = runtime.SlotWriter(str(control.path), hb.control_slot(hb.ROLE_SCHEDULER))
    writer.claim(1, -1, 0, hb.READY, 0.0, role=hb.ROLE_SCHEDULER)  # pid 1 (init) lives
    assert runtime.state.claim_control(hb.ROLE_SCHEDULER) is None
    assert control.read(0).pid == 1


def test_without_a_control_segment_nothing_is_claimed_and_the_engine_runs(control, monkeypatch):
    monkeypatch.delenv(runtime.ENV_CONTROL)
    patched("vllm.v1.engine.output_processor", OutputProcessor=OutputProcessor)
    proc = OutputProcessor()
    proc.add_request("a", "hello")
    assert proc.request_states == {"a": 0} and not front(control).claimed


class _Breaking:
    """A slot writer whose step could begin but cannot end (the slot went bad in between): the engine must not
    notice."""

    flags = hb.IN_STEP

    def set_phase(self, *_args):
        pass

    step_begin = set_phase

    def step_end(self, *_args):
        raise OSError("slot gone")

    step_shape = step_cancel = step_end


class Worker:
    def execute_model(self, scheduler_output):
        if scheduler_output == "boom":
            raise ValueError("the engine's own error")
        return "output"

    def sample_tokens(self, grammar_output):
        return None


def test_the_guest_never_raises_into_the_engine_nor_hides_its_exception(monkeypatch):
    """A failing slot writer inside vLLM's step: the step's result and the engine's own exception pass through
    unchanged (a ``finally`` that raised would have replaced it)."""
    patched("vllm.v1.worker.gpu_worker", Worker=Worker)
    monkeypatch.setattr(runtime.state, "writer", _Breaking())
    monkeypatch.setattr(runtime.state, "pid", __import__("os").getpid())
    assert Worker().execute_model("ok") == "output"
    with pytest.raises(ValueError, match="the engine's own error"):
        Worker().execute_model("boom")
    monkeypatch.setattr(runtime.state, "control", {hb.ROLE_SCHEDULER: _Breaking(), hb.ROLE_FRONTEND: _Breaking()})
    patched("vllm.v1.engine.output_processor", OutputProcessor=OutputProcessor)
    proc = OutputProcessor()
    proc.add_request("a", "hello")
    proc.process_outputs([("a", True)])
    assert proc.request_states == {}


def test_a_scrape_paused_by_the_front_end_leaves_no_stale_running_reading(tmp_path):
    """The engine's /metrics said one request was running when the front end's slot took over (the scrape
    pauses): once the engine has gone idle, nothing still says "running", so no hang is ruled on an idle engine
    (the last reading used to stay in force for ever)."""
    import dataclasses

    from tp_supervise.supervisor.observers.watchdog_thread import WatchdogThread
    from tp_supervise.supervisor.processes.attempt import NOT_STARTED, Attempt, Published
    from tp_supervise.supervisor.processes.spawn import RankHandle, RankSpec
    from tp_supervise.supervisor.spec import LaunchSpec, MetricsOptions, WatchdogOptions
    from tp_supervise.watchdogs.progress import ExternalProgress

    spec = LaunchSpec(
        command=("python", "-m", "vllm.entrypoints.openai.api_server"),
        nproc_per_node=1,
        tree=True,
        zero_code_hook=False,
        metrics=MetricsOptions(addr=None),
        watchdog=WatchdogOptions(hard_timeout=2.0, soft_timeout=1.0, engine_metrics_url="http://127.0.0.1:9/metrics"),
    )
    cell = Published(NOT_STARTED)
    front_pid = 4242
    rank = hb.empty_slot(0)
    rank = dataclasses.replace(rank, pid=4343, rank=0, flags=hb.CLAIMED | hb.READY)
    front = dataclasses.replace(hb.empty_slot(1), pid=front_pid, rank=-1, flags=hb.CLAIMED | hb.READY, role=2)
    control: list[hb.SlotSnapshot] = []
    posted: list = []
    wd = WatchdogThread(spec, lambda: [rank], cell, posted.append, lambda *a: None, read_control=lambda: control)
    attempt = Attempt(cell.set, started_at=1.0, number=1)
    attempt.set_launcher(RankHandle(RankSpec(slot=-1, rank=-1, argv=(), env={}), pid=front_pid, started_at=1.0))
    attempt.add_rank(RankHandle(RankSpec(slot=0, rank=0, argv=(), env={}), pid=4343, started_at=1.0))
    assert wd.adapter is not None
    wd.adapter.latest = ExternalProgress(tokens_total=10.0, running=1.0, ok=True)  # what a scrape said
    now = 10.0
    for _ in range(5):
        now += 0.1
        wd.tick(now)
    control.append(dataclasses.replace(front, flags=front.flags | hb.IN_STEP))  # a request: the front end claims
    wd.tick(now + 0.1)
    assert wd.adapter.paused
    control[0] = dataclasses.replace(front, step=1)  # its output came, nothing in flight: the engine is idle
    for i in range(60):  # 6 s of an idle engine
        wd.tick(now + 0.2 + 0.1 * i)
    kinds = [getattr(p, "kind", None) for p in posted]
    assert not [k for k in kinds if k is not None and k.value in ("soft", "hard")], kinds


def test_which_launchers_serve_the_api_and_which_start_several_control_processes():
    assert engines.serves_api(".venv/bin/python -m vllm.entrypoints.openai.api_server --model m --port 8001")
    assert engines.serves_api("/usr/bin/vllm serve m --tensor-parallel-size 8")
    assert not engines.serves_api("vllm serve m --nnodes 2 --node-rank 1 --headless")
    assert engines.serves_api("python -m sglang.launch_server --model-path m --tp 8")
    # SGLang's nodes > 0 of its own multi-node launch run its schedulers only
    assert not engines.serves_api("python -m sglang.launch_server --model-path m --tp 16 --nnodes 2 --node-rank 1")
    assert engines.serves_api("python -m sglang.launch_server --model-path m --tp 16 --nnodes 2 --node-rank=0")
    assert not engines.serves_api("torchrun --nproc-per-node 8 train.py")
    assert engines.several_control(("vllm", "serve", "m", "--api-server-count", "2"))
    assert engines.several_control(("vllm", "serve", "m", "--data-parallel-size=4"))
    assert not engines.several_control(("vllm", "serve", "m", "--api-server-count", "1", "--tp", "2"))


def test_a_rank_that_is_also_the_scheduler_is_held_once_and_stays_a_rank():
    """TP=1: vLLM runs its worker inside the engine core, so the scheduler's claim names a rank's pid."""
    from tp_supervise.supervisor.processes.attempt import NOT_STARTED, Attempt, Published, RankView
    from tp_supervise.supervisor.processes.spawn import RankHandle, RankSpec

    cell = Published(NOT_STARTED)
    attempt = Attempt(cell.set, started_at=1.0, number=1)
    rank = RankHandle(RankSpec(slot=0, rank=0, argv=(), env={}), pid=4343, started_at=1.0)
    launcher = RankHandle(RankSpec(slot=-1, rank=-1, argv=(), env={}), pid=4242, started_at=1.0)
    launcher.title = "python -m vllm.entrypoints.openai.api_server --model m"
    attempt.add_rank(rank)
    attempt.set_launcher(launcher)
    assert RankView.of(launcher).role == "frontend"  # an engine's API server launcher, by its command line
    assert attempt.set_role(4343, "scheduler") and RankView.of(rank).role == "rank"
    assert len(attempt.processes()) == 2
    assert not attempt.set_role(5555, "scheduler")  # not held: the caller holds it


def test_the_scrape_pause_drops_any_reading_taken_before_it():
    from tp_supervise.supervisor.observers.watchdog_thread import AdapterThread
    from tp_supervise.watchdogs.progress import ExternalProgress

    adapter = AdapterThread("http://127.0.0.1:9/metrics", "vllm")
    adapter.latest = ExternalProgress(tokens_total=1.0, running=1.0, ok=True)
    adapter.pause(True)
    assert adapter.paused and adapter.latest is None
    adapter.pause(False)
    assert not adapter.paused and adapter.latest is None


def test_a_release_outside_the_checked_range_is_wrapped_and_said_once(monkeypatch, capsys):
    """The installed vLLM is older than the releases its seams were checked on (engines/vllm.py
    CHECKED_RELEASES): seams whose signatures match are wrapped all the same, and one line (the supervisor logs it
    as ``engine_adapter_unchecked``) names them, the range, and what a run without them loses."""
    monkeypatch.setitem(__import__("sys").modules, "vllm", types.SimpleNamespace(__version__="0.26.1"))
    monkeypatch.setattr(engines, "_reported", set())
    module = patched("vllm.v1.engine.output_processor", OutputProcessor=type("OP", (OutputProcessor,), {}))
    try:
        assert getattr(module.OutputProcessor.add_request, "__tp_supervise_wrapped__", False)
        err = capsys.readouterr().err.splitlines()
        lines = [line for line in err if line.startswith(f"supervise: {engines.UNCHECKED} vllm 0.26.1 ")]
        assert len(lines) == 1, err
        low, high = engines.vllm.CHECKED_RELEASES
        assert f"OutputProcessor.add_request checked on {low}..{high}" in lines[0]
        assert "requests in flight" in lines[0] and "--no-hook" in lines[0]
        patched("vllm.v1.engine.output_processor", OutputProcessor=type("OP2", (OutputProcessor,), {}))
        assert not [l for l in capsys.readouterr().err.splitlines() if engines.UNCHECKED in l], "said once"
    finally:
        engines.uninstrument()
    monkeypatch.setitem(__import__("sys").modules, "vllm", types.SimpleNamespace(__version__=f"{high}+cpu"))
    monkeypatch.setattr(engines, "_reported", set())
    patched("vllm.v1.engine.output_processor", OutputProcessor=type("OP3", (OutputProcessor,), {}))
    engines.uninstrument()
    assert engines.UNCHECKED not in capsys.readouterr().err, "a checked release says nothing"
