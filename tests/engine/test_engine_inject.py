"""Every --inject kind does what it says (observable behaviour only; detection is the supervisor's job).

STEP counts decode steps: with one request, engine step 1 is its prefill and
decode step N is engine step N + 1.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.engine.conftest import post, proc_state, read_trace, wait_for

pytestmark = pytest.mark.e2e

VOCAB = 258  # the default random model's byte vocabulary
SLOW_DELAY_S = 0.2
HANG_SETTLE_S = 1.0


def fire(engine, prompts, max_tokens=8, timeout=5.0) -> dict:
    """POST greedy requests from background threads (they may never be answered)."""
    results: dict = {}

    def one(i, prompt):
        try:
            results[i] = post(engine.url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                           "return_token_ids": True, "ignore_eos": True}, timeout=timeout)
        except OSError as exc:
            results[i] = exc

    for i, prompt in enumerate(prompts):
        threading.Thread(target=one, args=(i, prompt), name=f"test-request-{i}", daemon=True).start()
    return results


def tokens(engine, prompt, max_tokens=8) -> list[int]:
    status, body = post(engine.url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                     "return_token_ids": True, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def exited(engine, rank, timeout_s=20.0) -> int:
    return wait_for(lambda: engine.procs[rank].poll() is not None and [engine.procs[rank].returncode],
                    timeout_s, f"rank {rank} to exit")[0]


def test_hang_collective_skips_one_all_reduce(launch_engine, heartbeat):
    engine = launch_engine("--inject", "hang_collective@1:2", rank_env=heartbeat.rank_env(2))
    fire(engine, ["hello"])

    def hung():
        r0, r1 = heartbeat.read(0), heartbeat.read(1)
        return (r0.in_collective and r0.coll_op == "all_reduce" and not r1.in_collective
                and r1.in_step and r0.coll_seq == r1.coll_seq + 1) and (r0, r1)

    wait_for(hung, 20, "rank 0 inside all_reduce, rank 1 one collective behind")
    time.sleep(HANG_SETTLE_S)
    r0, r1 = hung()  # still the same picture: nobody moves
    assert r0.step == r1.step == 2  # prefill + decode step 1 completed
    assert [proc_state(p.pid) for p in engine.procs] == ["S", "S"]
    assert "_injected_collective_skip" in heartbeat.stacks(1, engine.procs[1].pid)
    assert "all_reduce" in heartbeat.stacks(0, engine.procs[0].pid)


def test_hang_scheduler_stalls_outside_collectives(launch_engine, heartbeat):
    engine = launch_engine("--control-plane", "replicated", "--inject", "hang_scheduler@1:2",
                           rank_env=heartbeat.rank_env(2))
    fire(engine, ["hello"])

    def hung():
        r0, r1 = heartbeat.read(0), heartbeat.read(1)
        return r0.in_collective and r1.in_step and not r1.in_collective and r1.phase == "schedule" and (r0, r1)

    wait_for(hung, 20, "rank 1 stalled in its scheduler while rank 0 waits in a collective")
    time.sleep(HANG_SETTLE_S)
    r0, r1 = hung()
    assert r0.coll_op == "all_reduce" and r0.coll_seq == r1.coll_seq + 1
    stacks = heartbeat.stacks(1, engine.procs[1].pid)
    assert "_injected_scheduler_stall" in stacks and "begin_step" in stacks
    assert proc_state(engine.procs[1].pid) == "S"


def test_stop_sigstops_the_rank(launch_engine):
    engine = launch_engine("--inject", "stop@1:2")
    fire(engine, ["hello"])
    wait_for(lambda: proc_state(engine.procs[1].pid) == "T", 20, "rank 1 stopped")
    time.sleep(HANG_SETTLE_S)
    assert proc_state(engine.procs[1].pid) == "T" and proc_state(engine.procs[0].pid) == "S"
    assert engine.procs[0].poll() is None


@pytest.mark.parametrize("plane,rank", [("broadcast", 1), ("replicated", 0)])
def test_crash_raises_a_python_exception(launch_engine, plane, rank):
    engine = launch_engine("--control-plane", plane, "--inject", f"crash@{rank}:2")
    fire(engine, ["hello"])
    assert exited(engine, rank) == 1  # a plain exit status, not a signal from torch teardown
    err = engine.stderr(rank)
    assert "Traceback" in err and f"InjectedFault: injected crash on rank {rank} at decode step 2" in err


def test_exit_leaves_without_a_trace(launch_engine):
    engine = launch_engine("--inject", "exit@1:2")
    fire(engine, ["hello"])
    assert exited(engine, 1) == 1
    assert "Traceback" not in engine.stderr(1)


def test_segfault_dies_of_sigsegv(launch_engine):
    engine = launch_engine("--inject", "segfault@0:1")
    fire(engine, ["hello"])
    assert exited(engine, 0) == -signal.SIGSEGV


def test_abort_dies_of_sigabrt_from_another_thread(launch_engine, heartbeat):
    engine = launch_engine("--inject", "abort@1:2", rank_env=heartbeat.rank_env(2))
    fire(engine, ["hello"])
    assert exited(engine, 1) == -signal.SIGABRT
    assert "Traceback" not in engine.stderr(1)


def test_diverge_token_broadcast_rank0_is_authoritative(launch_engine, tmp_path):
    """Rank 1's different token stays local (plans carry rank 0's); rank 0's changes the output."""
    engine = launch_engine("--trace-events", str(tmp_path / "trace"),
                           "--inject", "diverge_token@1:2", "--inject", "diverge_token@0:4")
    diverged = tokens(engine, "hello")
    clean = tokens(engine, "hello")  # the injections fired once, at decode steps 2 and 4
    assert diverged[:4] == clean[:4]
    assert diverged[4] == (clean[4] + 1) % VOCAB
    r0 = read_trace(tmp_path / "trace" / "rank-0.jsonl")
    r1 = read_trace(tmp_path / "trace" / "rank-1.jsonl")
    mismatched = [(a["index"], a["events"]["tokens"], b["events"]["tokens"])
                  for a, b in zip(r0, r1) if a["events"]["tokens"] != b["events"]["tokens"]]
    assert mismatched == [(3, [clean[2]], [(clean[2] + 1) % VOCAB]),
                          (5, [(clean[4] + 1) % VOCAB], [clean[4]])]


def test_diverge_token_replicated_is_healed_by_sync_token_ids(launch_engine, tmp_path):
    engine = launch_engine("--control-plane", "replicated", "--sync-token-ids",
                           "--trace-events", str(tmp_path / "trace"), "--inject", "diverge_token@1:2")
    diverged = tokens(engine, "hello")
    assert diverged == tokens(engine, "hello")  # the MIN all-reduce kept rank 0's token
    r0 = read_trace(tmp_path / "trace" / "rank-0.jsonl")
    r1 = read_trace(tmp_path / "trace" / "rank-1.jsonl")
    local = [(a["index"], b["events"]["tokens"][0] - a["events"]["tokens"][0])
             for a, b in zip(r0, r1) if a["events"]["tokens"] != b["events"]["tokens"]]
    assert local == [(3, 1)]  # rank 1 sampled token + 1 at decode step 2


def test_diverge_batch_runs_a_different_batch(launch_engine, tmp_path):
    """Rank 1 drops a sequence: the all-reduce shapes differ and the group fails (gloo aborts)."""
    engine = launch_engine("--control-plane", "replicated", "--trace-events", str(tmp_path / "trace"),
                           "--inject", "diverge_batch@1:4")
    results = fire(engine, ["hello", "world"], max_tokens=12, timeout=20)
    codes = [exited(engine, r) for r in range(2)]
    assert codes[0] != 0 and codes[1] != 0, codes
    r0 = read_trace(tmp_path / "trace" / "rank-0.jsonl", partial=True)
    r1 = read_trace(tmp_path / "trace" / "rank-1.jsonl", partial=True)
    assert r0[-1]["index"] is None and r1[-1]["index"] is None  # the step never completed
    assert len(r0[-1]["events"]["batch"]) == 2
    assert r1[-1]["events"]["batch"] == r0[-1]["events"]["batch"][:1]
    wait_for(lambda: len(results) == 2, 20, "clients to be answered")
    assert all(not (isinstance(r, tuple) and r[0] == 200) for r in results.values())


def test_slow_adds_latency_to_every_step(launch_engine, heartbeat):
    engine = launch_engine("--inject", "slow@1:1", rank_env=heartbeat.rank_env(2))
    started = time.monotonic()
    assert len(tokens(engine, "hello", max_tokens=8)) == 8
    elapsed = time.monotonic() - started
    assert elapsed >= 7 * SLOW_DELAY_S  # 7 decode steps after the prefill
    assert heartbeat.read(1).last_step_s >= SLOW_DELAY_S
    assert heartbeat.read(0).last_step_s >= SLOW_DELAY_S * 0.9  # rank 0 waits for it in the all-reduce
