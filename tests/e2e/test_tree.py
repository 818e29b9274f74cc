"""Tree mode: the command is a launcher; ranks are found when they join the group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.live import wait_for
from tests.support.freezer import freeze_thread, thaw

pytestmark = pytest.mark.e2e

FAKES = Path(__file__).resolve().parents[1] / "fakes"
VENV_BIN = Path(sys.executable).parent


def mp_launcher(*args: str) -> list[str]:
    return [sys.executable, str(FAKES / "mp_launcher.py"), *args]


def test_multiprocessing_launcher_clean_run(supervise):
    run = supervise(["--tree", "--nproc-per-node", "2"], mp_launcher("--tp", "2", "--iters", "60"))
    assert run.wait(timeout=90) == 0, run.stderr[-4000:]
    joined = run.events("rank joined the group")
    assert sorted(line["rank"] for line in joined) == [0, 1]
    assert run.bundles() == []


def test_a_rank_that_dies_inside_init_process_group_is_named_at_once(supervise):
    """Rank 0's store cannot bind its port: it dies inside init_process_group and rank 1 waits on a store that
    never answers, with the launcher waiting on rank 1.  Found at the start of its rendezvous, rank 0 is named
    as the rank that ended while joining, with its own error, long before the startup timeout (600 s)."""
    run = supervise(["--tree", "--nproc-per-node", "2"], mp_launcher("--tp", "2", "--fault", "port-taken"))
    assert run.wait(timeout=120) == 80, run.stderr[-4000:]
    summary = run.summary("-rank_exit")
    assert summary["culprit_ranks"] == [0], summary["verdict"]
    assert "while joining the process group" in summary["verdict"], summary["verdict"]
    assert "EADDRINUSE" in summary["verdict"], summary["verdict"]
    assert run.events("startup timeout") == []


def test_multiprocessing_launcher_stopped_rank_is_a_hang(supervise):
    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--fault", "stop", "--fault-at", "40"),
    )
    assert run.wait(timeout=90) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"


@pytest.mark.slow
def test_ranks_that_rename_themselves_stay_held(supervise):
    """setproctitle (vLLM, SGLang) wipes /proc/<pid>/environ, run marker included: the ranks are still the run's
    (its cgroup, their ancestry), a clean run stays clean and a stopped rank is still the hang's culprit, named
    with its new title."""
    run = supervise(["--tree", "--nproc-per-node", "2"], mp_launcher("--tp", "2", "--iters", "150", "--set-title"))
    assert run.wait(timeout=90) == 0, run.stderr[-4000:]
    assert sorted(line["rank"] for line in run.events("rank joined the group")) == [0, 1]
    assert run.bundles() == [], run.stderr[-4000:]

    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--fault", "stop", "--fault-at", "60", "--set-title"),
    )
    assert run.wait(timeout=90) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    assert hang["ranks"]["1"]["title"] == "VLLM::Worker_TP1", hang["ranks"]["1"]
    assert hang["ranks"]["0"]["title"] == "VLLM::Worker_TP0", hang["ranks"]["0"]


@pytest.mark.slow
def test_a_restarted_attempt_whose_ranks_join_late_is_not_judged_by_the_last_attempts_slots(supervise):
    """--max-restarts in tree mode with ranks that join seconds after the restart (vLLM loads its model again):
    the slots still name the dead ranks of the first attempt, busy in an all_reduce.  Neither is a rank of the
    new attempt (no 'vanished' rank 0, no hang of the new attempt); the new ranks crash as the first did."""
    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--max-restarts", "1", "--soft-timeout", "2", "--hard-timeout", "4",
         "--kill-grace", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--fault", "crash", "--fault-at", "40", "--restart-delay", "8"),
    )
    assert run.wait(timeout=120) == 80, run.stderr[-4000:]
    names = [b.name for b in run.bundles() if "hang_suspected" not in b.name]
    assert len(names) == 2 and all("rank_exit" in n for n in names), names
    exits = run.events("rank_exited")
    assert [line["rank"] for line in exits] == [1, 1], exits
    assert exits[0]["pid"] != exits[1]["pid"]
    assert not run.events("hang suspected")


def test_engine_process_killed_is_the_first_failure(supervise, tmp_path):
    """launcher -> engine core -> workers, as vLLM runs: the engine core SIGKILLed is the fault, named by its
    title and its signal (read from its zombie before its own parent reaps it), not the workers it leaves."""
    pidfile = tmp_path / "core.pid"
    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--kill-grace", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--set-title", "--engine-core", str(pidfile)),
    )
    core = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 60, "the engine core's pid file"))
    wait_for(lambda: all(pidfile.with_name(f"core.pid.joined-{r}").exists() for r in (0, 1)), 60, "both ranks joined")
    time.sleep(1.0)  # the claims reach the supervisor's loop
    os.kill(core, signal.SIGKILL)
    assert run.wait(timeout=60) == 80, run.stderr[-4000:]
    held = run.events("engine process held")
    assert [line["pid"] for line in held] == [core] and held[0]["title"] == "VLLM::EngineCore", held
    summary = run.summary("rank_exit")
    assert summary["culprit_ranks"] == [], summary["verdict"]
    first = summary["first_failure"]
    assert (first["role"], first["pid"], first["title"]) == ("scheduler", core, "VLLM::EngineCore"), first
    assert "engine core" in summary["verdict"] and "VLLM::EngineCore" in summary["verdict"], summary["verdict"]
    # Its parent (the launcher, in Python) reaps it later than the exit monitor wakes: the signal is known.
    assert first["signal"] == "SIGKILL" or first["reason"] == "lost", first


def test_engine_process_slow_to_exit_is_still_the_first_failure(supervise, tmp_path, freezer):
    """The engine core SIGKILLed while one of its threads cannot exit yet (frozen: as a big process's last
    thread freeing its memory, only longer): its workers die of their parent-death signal at once, and their
    exits are readable before the core's.  The core is still the first failure."""
    import psutil

    pidfile = tmp_path / "core.pid"
    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--kill-grace", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--set-title", "--engine-core", str(pidfile)),
        drain=True,
    )
    core = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 60, "the engine core's pid file"))
    wait_for(lambda: all(pidfile.with_name(f"core.pid.joined-{r}").exists() for r in (0, 1)), 60, "both ranks joined")
    stderr_lines = run.drains[1][1]
    wait_for(lambda: sum("engine process held" in line for line in stderr_lines), 30, "the engine core held")
    workers = psutil.Process(core).children()
    assert len(workers) == 2, workers
    thread = int(pidfile.with_name("core.pid.thread").read_text())
    freeze_thread(freezer, thread)
    try:
        os.kill(core, signal.SIGKILL)

        def exited(proc: psutil.Process) -> bool:
            try:
                return proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_for(lambda: all(exited(w) for w in workers), 10, "the workers dead of their parent-death signal")
        assert Path(f"/proc/{core}/task/{thread}").exists(), "the core's frozen thread is gone"
        time.sleep(0.5)  # the workers' exits are read by now
    finally:
        thaw(freezer)
    assert run.wait(timeout=60) == 80, run.stderr[-4000:]
    first = run.summary("rank_exit")["first_failure"]
    assert (first["role"], first["pid"], first["title"]) == ("scheduler", core, "VLLM::EngineCore"), first


def test_supervisor_sigkill_takes_the_whole_launcher_tree(supervise, tmp_path):
    """launcher -> engine core -> workers (vLLM's shape), the supervisor SIGKILLed: the launcher dies of its
    parent-death signal, and the engine core and the workers, which have none, of the hook's watch on the
    supervisor (their stderr is a pipe to the dead supervisor: the watch must not die writing to it)."""
    import psutil

    pidfile = tmp_path / "core.pid"
    run = supervise(
        ["--tree", "--nproc-per-node", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--set-title", "--engine-core", str(pidfile)),
    )
    core = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 60, "the engine core's pid file"))
    wait_for(lambda: all(pidfile.with_name(f"core.pid.joined-{r}").exists() for r in (0, 1)), 60, "both ranks joined")
    tree = [psutil.Process(core), *psutil.Process(core).children(recursive=True)]
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=10)

    def alive() -> list[int]:
        return [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    wait_for(lambda: not alive(), 10, "the engine core and its workers gone")


def test_multiprocessing_launcher_crashed_rank(supervise):
    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--kill-grace", "2"],
        mp_launcher("--tp", "2", "--iters", "100000", "--fault", "crash", "--fault-at", "40"),
    )
    assert run.wait(timeout=90) == 80, run.stderr[-4000:]
    summary = run.summary("rank_exit")
    assert summary["culprit_ranks"] == [1], summary["verdict"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(FAKES / "hf_tp_generate.py"), "--make", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.slow
def test_torchrun_transformers_tp_generate(supervise, tiny_llama):
    torchrun = str(VENV_BIN / "torchrun")
    script = str(FAKES / "hf_tp_generate.py")
    run = supervise(
        ["--tree", "--nproc-per-node", "2", "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"],
        [torchrun, "--nproc-per-node", "2", script, "--model", str(tiny_llama), "--loops", "4000", "--fault", "stop", "--fault-at", "3"],
    )
    assert run.wait(timeout=120) == 81, run.stderr[-4000:]
    assert sorted(line["rank"] for line in run.events("rank joined the group")) == [0, 1]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]


def test_engine_counters_detect_a_hang_without_python_collectives(supervise):
    from tp_supervise.supervisor.rank.net import free_port

    port = free_port()
    run = supervise(
        [
            "--tree", "--nproc-per-node", "1", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "1",
            "--engine-metrics-url", f"http://127.0.0.1:{port}/metrics", "--engine-kind", "vllm",
        ],
        [sys.executable, str(FAKES / "fake_vllm.py"), "--port", str(port), "--freeze-after", "3"],
    )
    assert run.wait(timeout=60) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["watchdog"]["external"]["running"] >= 1
    assert any("hang_suspected" in b.name for b in run.bundles())


def test_engine_counters_progressing_is_not_a_hang(supervise):
    from tp_supervise.supervisor.rank.net import free_port

    port = free_port()
    run = supervise(
        [
            "--tree", "--nproc-per-node", "1", "--soft-timeout", "2", "--hard-timeout", "4",
            "--engine-metrics-url", f"http://127.0.0.1:{port}/metrics", "--engine-kind", "vllm",
        ],
        [sys.executable, str(FAKES / "fake_vllm.py"), "--port", str(port), "--run-for", "8"],
    )
    assert run.wait(timeout=60) == 0, run.stderr[-4000:]
    assert run.bundles() == []
