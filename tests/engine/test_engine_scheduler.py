"""Continuous-batching scheduler, request validation, stop matching, bridge (torch-free)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tp_supervise.engine.bridge import EngineBridge, EngineError
from tp_supervise.engine.openai_api import ApiError, StopMatcher, check_context, parse_completion
from tp_supervise.engine.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig, SeqOutput
from tp_supervise.engine.tokenizer import ByteTokenizer, IncrementalDecoder

EOS = 99


def req(rid: str, n_prompt: int = 3, max_tokens: int = 4, ignore_eos: bool = False, isolate: bool = False) -> Request:
    return Request(rid, tuple(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   isolate=isolate)


def sched(max_batch=4, max_batch_tokens=100, max_context=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_batch, max_batch_tokens, max_context, (EOS,)))


def run_step(s: Scheduler, token=7):
    plan = s.schedule()
    assert plan is not None
    return plan, s.complete(plan, [token] * len(plan.items))


def test_prefill_then_decode_positions():
    s = sched()
    s.add(req("a", n_prompt=3))
    plan, out = run_step(s, token=10)
    assert plan.describe() == [["a", 0, 3]] and plan.items[0].is_prefill and not plan.has_decode
    assert out == [SeqOutput("a", 10, False, None)]
    plan, _ = run_step(s, token=11)
    assert plan.describe() == [["a", 3, 1]] and plan.items[0].token_ids == (10,) and plan.has_decode
    plan, _ = run_step(s)
    assert plan.describe() == [["a", 4, 1]] and plan.items[0].token_ids == (11,)


def test_schedule_has_no_side_effects():
    s = sched()
    s.add(req("a"))
    assert s.schedule() == s.schedule()
    assert s.num_waiting == 1 and s.num_running == 0


def test_requests_join_and_leave_between_steps():
    s = sched()
    s.add(req("a", max_tokens=3))
    run_step(s)
    s.add(req("b", max_tokens=2))
    plan, out = run_step(s)
    assert plan.describe() == [["a", 3, 1], ["b", 0, 3]]
    plan, out = run_step(s)
    assert [(o.seq_id, o.finished, o.finish_reason) for o in out] == [("a", True, "length"), ("b", True, "length")]
    assert not s.has_work()
    assert s.pending_release() == ("a", "b")
    s.add(req("c"))
    plan = s.schedule()
    assert plan.release == ("a", "b")
    s.complete(plan, [1])
    assert s.pending_release() == ()


def test_max_batch_and_token_budget():
    s = sched(max_batch=2, max_batch_tokens=5)
    for rid in "abc":
        s.add(req(rid, n_prompt=3))
    plan, _ = run_step(s)
    assert [it.seq_id for it in plan.items] == ["a"]  # b would exceed the prompt-token budget
    plan, _ = run_step(s)
    assert [it.seq_id for it in plan.items] == ["a", "b"]  # max_batch 2: c waits
    assert s.num_waiting == 1


def test_oversized_prompt_still_runs_alone():
    s = sched(max_batch_tokens=4)
    s.add(req("big", n_prompt=10))
    plan, _ = run_step(s)
    assert plan.describe() == [["big", 0, 10]]


def test_a_suspect_is_prefilled_alone_and_the_others_resume_after_it():
    """A suspect of a failed attempt gets a step of its own: no other prefill, no decode (docs/engine.md)."""
    s = sched(max_batch=8)
    s.add(req("running", max_tokens=10))
    run_step(s)
    for rid, isolate in (("b1", False), ("p", True), ("b2", True), ("b3", False)):
        s.add(req(rid, isolate=isolate, max_tokens=10))
    plans = [run_step(s)[0].describe() for _ in range(4)]
    assert plans == [
        [["running", 3, 1], ["b1", 0, 3]],  # b1 is first in line; the suspect behind it waits for the next step
        [["p", 0, 3]],  # alone: the running sequences skip this step
        [["b2", 0, 3]],
        [["running", 4, 1], ["b1", 3, 1], ["p", 3, 1], ["b2", 3, 1], ["b3", 0, 3]],  # decodes resume one step late
    ]
    assert s.num_waiting == 0 and s.num_running == 5


def test_a_suspect_waits_for_a_free_slot_like_any_request():
    s = sched(max_batch=1)
    s.add(req("a", max_tokens=2))
    s.add(req("p", isolate=True))
    assert [run_step(s)[0].describe() for _ in range(3)] == [[["a", 0, 3]], [["a", 3, 1]], [["p", 0, 3]]]


def test_eos_stops_unless_ignored():
    s = sched()
    s.add(req("a", max_tokens=10))
    s.add(req("b", max_tokens=10, ignore_eos=True))
    plan, out = run_step(s, token=EOS)
    assert [(o.seq_id, o.finish_reason) for o in out] == [("a", "stop"), ("b", None)]


def test_context_limit_finishes_with_length():
    s = sched(max_context=6)
    s.add(req("a", n_prompt=4, max_tokens=100))
    outs = []
    while s.has_work():
        outs += run_step(s)[1]
    assert len(outs) == 2 and outs[-1].finish_reason == "length"


def test_abort_running_and_waiting():
    s = sched(max_batch=1)
    s.add(req("a"))
    s.add(req("b"))
    run_step(s)
    assert s.abort("a") and s.abort("b") and not s.abort("zzz")
    assert not s.has_work()
    assert set(s.pending_release()) == {"a", "b"}


def test_dropping_an_item_defers_it():
    """A plan without its last item (diverge_batch) leaves that sequence untouched."""
    s = sched()
    s.add(req("a"))
    s.add(req("b"))
    plan = s.schedule().without_last()
    s.complete(plan, [5])
    again = s.schedule()
    assert again.describe() == [["a", 3, 1], ["b", 0, 3]]


def test_rejects_bad_inputs():
    s = sched(max_context=4)
    with pytest.raises(ValueError):
        s.add(req("a", n_prompt=4))
    s.add(req("b"))
    with pytest.raises(ValueError):
        s.complete(s.schedule(), [1, 2])


def test_identical_inputs_give_identical_plans():
    """The replicated plane's premise: same inputs, same decisions."""
    a, b = sched(max_batch=3), sched(max_batch=3)
    for s in (a, b):
        for i in range(5):
            s.add(req(f"r{i}", n_prompt=2 + i, max_tokens=2 + i % 3))
    while a.has_work():
        pa, pb = a.schedule(), b.schedule()
        assert pa == pb
        tokens = [(len(it.token_ids) * 7) % 50 for it in pa.items]
        assert a.complete(pa, tokens) == b.complete(pb, tokens)
    assert not b.has_work()


# -- request validation ------------------------------------------------------------
def parse(body):
    return parse_completion(body, model_name="m", vocab_size=100)


def test_parse_defaults_and_extensions():
    gen = parse({"prompt": "hi"}).gen
    assert (gen.max_tokens, gen.temperature, gen.top_p, gen.seed, gen.stop, gen.stream) == (
        16, 1.0, 1.0, None, (), False)
    spec = parse({"prompt": [[1, 2, 3]], "model": "m", "stop": ["x", ""], "ignore_eos": True,
                  "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True},
                  "seed": 5, "temperature": 0, "top_p": 0.5, "max_tokens": 3})
    gen = spec.gen
    assert spec.prompt_ids == (1, 2, 3) and gen.stop == ("x",) and gen.ignore_eos and gen.return_token_ids
    assert gen.include_usage and gen.seed == 5 and gen.temperature == 0.0


@pytest.mark.parametrize("body,status,param", [
    ([1, 2], 400, None),
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 100]}, 400, "prompt"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "stop": 3}, 400, "stop"),
    ({"prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
])
def test_parse_rejects(body, status, param):
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == status and err.value.param == param
    assert err.value.body()["error"]["message"]


def test_context_check():
    check_context(10, 6, 16)
    with pytest.raises(ApiError, match="maximum context length is 16"):
        check_context(10, 7, 16)
    with pytest.raises(ApiError) as err:
        check_context(20, 1, 16)
    assert err.value.param == "prompt"


# -- stop strings and incremental decoding ------------------------------------------
def feed_all(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = "", False
    for d in deltas:
        text, stopped = m.feed(d)
        out += text
        if stopped:
            return out, True
    return out + m.flush(), False


@pytest.mark.parametrize("stops,deltas,expected", [
    ((), ["ab", "c"], ("abc", False)),
    (("END",), ["hello E", "N", "D more"], ("hello ", True)),
    (("END",), ["hello E", "N", "x"], ("hello ENx", False)),
    (("ab", "b"), ["xa", "b"], ("x", True)),  # the earliest match wins
    (("\n\n",), ["line\n", "\nrest"], ("line", True)),
    (("zz",), ["a", "z"], ("az", False)),
])
def test_stop_matcher(stops, deltas, expected):
    assert feed_all(stops, deltas) == expected


def test_stop_matcher_never_emits_a_held_prefix_early():
    m = StopMatcher(("STOP",))
    assert m.feed("abST") == ("ab", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P!") == ("", True)


def test_incremental_decoder_holds_partial_utf8():
    dec = IncrementalDecoder(ByteTokenizer())
    euro = list("€".encode())
    assert dec.push([ord("a")]) == "a"
    assert dec.push(euro[:1]) == ""
    assert dec.push(euro[1:2]) == ""
    assert dec.push(euro[2:]) == "€"
    assert dec.push([0xFF], final=True) == "\ufffd"


# -- bridge between the HTTP thread and the engine loop --------------------------------
def test_bridge_roundtrip_across_threads():
    bridge = EngineBridge()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    try:
        r1, r2 = req("r1"), req("r2")
        q1 = asyncio.run_coroutine_threadsafe(_submit(bridge, r1), loop).result(5)
        q2 = asyncio.run_coroutine_threadsafe(_submit(bridge, r2), loop).result(5)
        bridge.abort("r2")
        msg = bridge.drain(1.0)
        assert msg.requests == (r1, r2) and msg.aborts == ("r2",) and not msg.shutdown
        assert bridge.drain(None).empty
        bridge.deliver([SeqOutput("r1", 5, False), SeqOutput("r2", 6, False), SeqOutput("r1", 7, True, "length")])
        got = asyncio.run_coroutine_threadsafe(_take(q1, 2), loop).result(5)
        assert [o.token_id for o in got] == [5, 7]
        assert q2.empty()
        r3 = req("r3")
        q3 = asyncio.run_coroutine_threadsafe(_submit(bridge, r3), loop).result(5)
        bridge.request_shutdown("test")
        msg = bridge.drain(1.0)
        assert msg.shutdown and msg.requests == (r3,) and not bridge.accepting
        bridge.fail_all("bye")
        (err,) = asyncio.run_coroutine_threadsafe(_take(q3, 1), loop).result(5)
        assert err == EngineError("bye")
        with pytest.raises(RuntimeError):
            asyncio.run_coroutine_threadsafe(_submit(bridge, req("r4")), loop).result(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_bridge_drain_blocks_until_timeout():
    import time

    bridge = EngineBridge()
    t0 = time.monotonic()
    assert bridge.drain(0.2).empty
    assert time.monotonic() - t0 >= 0.15


async def _submit(bridge, request):
    return bridge.submit(request, asyncio.get_running_loop())


async def _take(q, n):
    return [await asyncio.wait_for(q.get(), 5) for _ in range(n)]
