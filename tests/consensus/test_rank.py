"""Rank-side recorder: no-op when off, digests and logs when on, the decorator."""

from __future__ import annotations

import os

import pytest

from tp_supervise.supervisor.rank import channel, encoding
from tp_supervise.supervisor.rank import consensus as consensus
from tp_supervise.supervisor.rank.ring import RingReader


@pytest.fixture
def recorder_env(tmp_path):
    """Configure the in-process recorder from a rank env; turn it off afterwards."""

    def make(mode="observe", **kw):
        env = channel.rank_env(tmp_path, 0, mode, **kw)
        env["RANK"] = "0"
        return consensus.configure(env), env

    yield make
    consensus.configure({})


def read_steps(env):
    r = RingReader(channel.ring_path(os.path.dirname(os.path.dirname(env[channel.ENV_RING])), 0))
    return r, [r.read_entry(i) for i in range(r.head())]


def test_off_is_a_no_op(tmp_path):
    assert consensus.configure({}) is None and not consensus.enabled()
    consensus.record("x", 1)
    consensus.end_step(0)
    env = channel.rank_env(tmp_path, 0, "off")
    assert channel.ENV_RING not in env and env[channel.ENV_MODE] == "off"
    assert consensus.configure(env) is None
    assert not (tmp_path / channel.RING_DIR).exists()


def test_bad_env_disables_instead_of_failing():
    assert consensus.configure({channel.ENV_MODE: "bogus"}) is None
    assert consensus.configure({channel.ENV_MODE: "observe", channel.ENV_RING: "/proc/none/x.ring"}) is None


def test_rank_env_round_trip(tmp_path):
    env = channel.rank_env(tmp_path, 3, "enforce", inband_every=5, depth=8, log_bytes=8192)
    spec = channel.RankConsensusSpec.from_env(env)
    assert spec.mode is channel.ConsensusMode.ENFORCE and spec.slot == 3 and spec.inband_every == 5
    assert spec.ring == channel.ring_path(tmp_path, 3) and (spec.depth, spec.log_bytes) == (8, 8192)
    with pytest.raises(ValueError):
        channel.rank_env(tmp_path, 0, "loud")
    with pytest.raises(ValueError):
        channel.rank_env(tmp_path, 0, "observe", depth=0)


def test_steps_publish_digest_of_their_log(recorder_env):
    rec, env = recorder_env()
    assert consensus.enabled()
    consensus.record("batch", {"ids": ["a", "b"]})
    consensus.record("sample", [1, 2])
    consensus.end_step(7)
    consensus.end_step(8)  # an empty step still publishes
    reader, (e7, e8) = read_steps(env)
    log = reader.read_log(e7)
    assert (e7.step, e7.count, e7.truncated) == (7, 2, False)
    assert e7.digest == encoding.digest(log)
    assert [encoding.decode_event(x) for x in encoding.split_log(log)] == [
        ("batch", {"ids": ["a", "b"]}),
        ("sample", [1, 2]),
    ]
    assert (e8.step, e8.count, reader.read_log(e8)) == (8, 0, b"")
    assert e8.digest == encoding.digest(b"")
    assert rec.last.step == 8 and rec.steps == 2


def test_events_of_the_open_step_are_visible_at_once(recorder_env):
    _rec, env = recorder_env()
    consensus.record("batch", {"ids": ["a"]})
    consensus.end_step(0)
    consensus.begin_step(1)
    consensus.record("batch", {"ids": ["b"]})
    reader, _ = read_steps(env)
    state = reader.read_state()
    assert (state.last_step, state.open_count, state.open_step) == (0, 1, 1)
    assert encoding.split_log(reader.read_range(state.open_pos, state.open_len)) == [
        encoding.encode_event("batch", {"ids": ["b"]}).encode()
    ]


def test_huge_step_keeps_head_of_log_and_digest_of_all(recorder_env):
    _rec, env = recorder_env(log_bytes=4096)  # a step may store 1 KiB
    events = [("tok", {"i": i, "pad": "x" * 40}) for i in range(200)]
    for kind, payload in events:
        consensus.record(kind, payload)
    consensus.end_step(0)
    full = b"".join(encoding.event_bytes(k, p) for k, p in events)
    reader, (entry,) = read_steps(env)
    kept = reader.read_log(entry)
    assert entry.truncated and entry.count == 200 and entry.digest == encoding.digest(full)
    assert 0 < len(kept) <= 1024 and full.startswith(kept) and kept.endswith(b"\n")
    consensus.record("small", 1)
    consensus.end_step(1)
    _, (_, nxt) = read_steps(env)
    assert not nxt.truncated and nxt.digest == encoding.digest(encoding.event_bytes("small", 1))


def test_decorator_records_args_result_and_raise(recorder_env):
    @consensus.rank_consensus(args=("n", "mode"))
    def pick(self_like, n, items, mode="fast"):
        if n < 0:
            raise KeyError(n)
        return items[:n]

    @consensus.rank_consensus
    def bare(x):
        return x * 2

    @consensus.rank_consensus(kind="custom", result=False, args=("x",))
    def named(x):
        return object()

    _rec, env = recorder_env()
    assert pick(object(), 2, [3, 4, 5]) == [3, 4]
    pick(None, n=1, items=[9], mode="slow")
    with pytest.raises(KeyError):
        pick(None, -1, [])
    assert bare(4) == 8
    named(5)
    consensus.end_step(0)
    reader, (entry,) = read_steps(env)
    events = [encoding.decode_event(x) for x in encoding.split_log(reader.read_log(entry))]
    qual = pick.__qualname__
    assert events == [
        (qual, {"args": {"n": 2, "mode": "fast"}, "result": [3, 4]}),
        (qual, {"args": {"n": 1, "mode": "slow"}, "result": [9]}),
        (qual, {"args": {"n": -1, "mode": "fast"}, "raised": "KeyError"}),
        (bare.__qualname__, {"result": 8}),
        ("custom", {"args": {"x": 5}}),
    ]


def test_decorator_is_transparent_when_off():
    consensus.configure({})
    calls = []

    @consensus.rank_consensus(args=("a",))
    def f(a):
        calls.append(a)
        return a

    assert f(3) == 3 and calls == [3]
    with pytest.raises(TypeError):
        consensus.rank_consensus(args=("nope",))(f.__wrapped__)
    with pytest.raises(TypeError):
        consensus.rank_consensus(args=("rest",))(lambda *rest: rest)


def test_forked_child_does_not_write_the_parent_ring(recorder_env):
    recorder_env()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        os.write(write_fd, b"1" if consensus.enabled() else b"0")
        consensus.end_step(99)  # must be a no-op
        os._exit(0)
    os.close(write_fd)
    try:
        assert os.read(read_fd, 1) == b"0"
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    assert consensus.enabled()


def test_inband_only_mode_records_without_a_ring(tmp_path):
    env = channel.rank_env(tmp_path, 0, "off", inband_every=2)
    try:
        rec = consensus.configure(env)
        assert rec is not None and rec.spec.ring is None
        consensus.record("a", 1)
        consensus.end_step(0)  # torch.distributed not initialised here: the check is skipped
        assert rec.last.count == 1 and rec.inband_checks == 0
        assert not (tmp_path / channel.RING_DIR).exists()
    finally:
        consensus.configure({})


def test_tree_mode_env_lets_the_rank_derive_its_slot(tmp_path):
    env = channel.rank_env(tmp_path, -1, "observe")
    assert channel.ENV_RING not in env and channel.ENV_SLOT not in env
    spec = channel.RankConsensusSpec.from_env({**env, "RANK": "5", "SUPERVISE_SLOT_BASE": "4"})
    assert spec.slot == 1 and spec.ring == channel.ring_path(tmp_path, 1) and spec.publishes
    spec = channel.RankConsensusSpec.from_env({**env, "SUPERVISE_SLOT": "2", "RANK": "9"})
    assert spec.ring == channel.ring_path(tmp_path, 2)
    assert not channel.RankConsensusSpec.from_env(env).publishes  # no rank known: nothing to publish
