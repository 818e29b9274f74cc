"""The engine over HTTP: HF-identical greedy generations at TP=1/2, both control planes, batching, API."""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from tests.engine.conftest import get, post, read_trace, stream, wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
IDLE_WINDOW_S = 2.0
IDLE_CPU_BUDGET_S = 0.3  # CPU seconds a rank may burn in IDLE_WINDOW_S (a spinning rank burns ~2)


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def engines(module_launcher, ckpt_a, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace")
    specs = {
        "tp1": (1, ()),
        "broadcast": (2, ("--control-plane", "broadcast", "--trace-events", str(trace / "broadcast"))),
        "replicated": (2, ("--control-plane", "replicated", "--trace-events", str(trace / "replicated"))),
    }
    started = {name: module_launcher("--model", str(ckpt_a), "--max-context", "256", *args, nproc=n, ready=False)
               for name, (n, args) in specs.items()}
    for engine in started.values():
        engine.wait_ready()
    started["trace"] = trace
    return started


@pytest.fixture(scope="module")
def hf_model(ckpt_a):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ckpt_a, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def complete(url: str, **body) -> dict:
    status, resp = post(url, {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **body})
    assert status == 200, resp
    return resp


PROMPTS = [[5, 9, 13], [200, 3], list(range(40, 90, 3))]


@pytest.mark.parametrize("name", ["tp1", "broadcast", "replicated"])
def test_greedy_generation_matches_hf_generate(engines, hf_model, name):
    url = engines[name].url
    for prompt in PROMPTS:
        expected = hf_greedy(hf_model, [1, *prompt], MAX_TOKENS)
        by_text = complete(url, prompt=words(prompt))
        by_ids = complete(url, prompt=[1, *prompt])
        assert by_text["choices"][0]["token_ids"] == expected
        assert by_ids["choices"][0]["token_ids"] == expected
        assert by_text["usage"] == {"prompt_tokens": len(prompt) + 1, "completion_tokens": len(expected),
                                    "total_tokens": len(prompt) + 1 + len(expected)}


@pytest.mark.parametrize("name", ["broadcast", "replicated"])
def test_16_concurrent_requests_are_batched_and_correct(engines, hf_model, name):
    rng = random.Random(16)
    prompts = [[1] + [rng.randrange(3, 251) for _ in range(rng.randrange(1, 20))] for _ in range(16)]
    expected = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    url = engines[name].url
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(url, prompt=p), prompts))
    assert [r["choices"][0]["token_ids"] for r in results] == expected
    steps = read_trace(engines["trace"] / name / "rank-0.jsonl")
    assert max(len(s["events"]["batch"]) for s in steps) >= 4, "requests were not batched together"
    # the workers executed the same batches (broadcast: rank 0's plans; replicated: own decisions)
    # Rank 0 answers as soon as it sampled; the worker may still be writing
    # its record of the last step(s).  Wait (bounded) for it to catch up.
    deadline = time.monotonic() + 10
    while True:
        worker = read_trace(engines["trace"] / name / "rank-1.jsonl")
        if len(worker) >= len(steps) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    worker = worker[: len(steps)]
    assert [s["events"]["batch"] for s in worker] == [s["events"]["batch"] for s in steps]
    assert [s["events"]["tokens"] for s in worker] == [s["events"]["tokens"] for s in steps]


def test_control_planes_give_identical_outputs(engines):
    """Greedy and seeded top-p sampling: same request, same output, on either plane."""
    bodies = [dict(prompt=words(p), temperature=t, top_p=tp, seed=s, max_tokens=16, ignore_eos=True)
              for p in PROMPTS for (t, tp, s) in ((0, 1.0, None), (0.9, 0.9, 7), (1.3, 1.0, 8))]
    for body in bodies:
        a = complete(engines["broadcast"].url, **body)["choices"][0]
        b = complete(engines["replicated"].url, **body)["choices"][0]
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
        assert len(a["token_ids"]) == 16


def test_seeded_sampling_is_reproducible(engines):
    url = engines["broadcast"].url
    body = dict(prompt=[1, 7, 8], temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    first = complete(url, seed=1234, **body)["choices"][0]["token_ids"]
    assert complete(url, seed=1234, **body)["choices"][0]["token_ids"] == first
    assert complete(url, seed=4321, **body)["choices"][0]["token_ids"] != first
    assert len(complete(url, **body)["choices"][0]["token_ids"]) == 24  # server-chosen seed


def test_streaming_matches_non_streaming(engines):
    url = engines["broadcast"].url
    body = dict(prompt=words([11, 12, 13]), max_tokens=10, temperature=0, return_token_ids=True, ignore_eos=True,
                stream_options={"include_usage": True})
    whole = complete(url, **body)
    events = stream(url, body)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_resumed_stream_continues_where_its_tokens_end(engines, path):
    """resume_token_ids (the relay's retry after a failed attempt): the engine prefills prompt + those tokens and
    streams the rest; greedy, the rest is what the uninterrupted stream had; usage counts every token."""
    url = engines["broadcast"].url
    prompt = {"prompt": words([21, 22, 23])} if "chat" not in path else {
        "messages": [{"role": "user", "content": words([21, 22, 23])}]}
    body = dict(prompt, max_tokens=12, temperature=0, return_token_ids=True, ignore_eos=True,
                stream_options={"include_usage": True})
    full = stream(url, body, path=path)
    ids = [t for c in full[:-2] for t in c["choices"][0].get("token_ids") or []]
    assert len(ids) == 12
    resumed = stream(url, dict(body, resume_token_ids=ids[:5]), path=path)
    chunks = resumed[:-2]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids[5:]
    assert all("role" not in c["choices"][0].get("delta", {}) for c in chunks), "a resumed stream has begun"
    assert resumed[-2]["usage"]["completion_tokens"] == 12
    assert resumed[-2]["usage"]["prompt_tokens"] == full[-2]["usage"]["prompt_tokens"]
    status, error = post(url, dict(body, stream=False, resume_token_ids=ids), path=path)
    assert status == 400 and error["error"]["param"] == "resume_token_ids"


def test_client_disconnect_aborts_the_sequence(engines):
    """Closing a stream mid-way frees the sequence: the engine stops stepping it and goes idle."""
    import json
    import urllib.request

    url = engines["broadcast"].url
    body = dict(prompt=[1, 77, 78], max_tokens=250, temperature=0, ignore_eos=True, stream=True)
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(request, timeout=30)
    first = json.loads(resp.readline().decode()[len("data: "):])
    seq_id = first["id"]
    resp.close()
    trace = engines["trace"] / "broadcast" / "rank-0.jsonl"

    def settled():
        size = trace.stat().st_size
        time.sleep(0.5)
        return trace.stat().st_size == size

    wait_for(settled, 30, "the engine to go idle")
    steps = [s for s in read_trace(trace) if any(item[0] == seq_id for item in s["events"]["batch"])]
    assert 1 <= len(steps) < 200


def test_stop_string_truncates(engines):
    url = engines["replicated"].url
    full = complete(url, prompt=words([21, 22]), max_tokens=8, ignore_eos=True)["choices"][0]
    pieces = full["text"].split(" ")
    assert len(pieces) >= 4
    stop = pieces[3]
    res = complete(url, prompt=words([21, 22]), max_tokens=8, ignore_eos=True, stop=[stop, "never"])["choices"][0]
    assert res["finish_reason"] == "stop"
    assert res["text"] == full["text"][: full["text"].index(stop)]
    streamed = stream(url, dict(prompt=words([21, 22]), max_tokens=8, temperature=0, ignore_eos=True, stop=stop))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == res["text"]
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "w5", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1, 251]}, 400, "prompt"),
    ({"prompt": [1, 5], "max_tokens": 300}, 400, "max_tokens"),
    ({"prompt": words(list(range(3, 251)) * 2)}, 400, "prompt"),
    ({"prompt": "w5", "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_json_errors(engines, body, status, param):
    url = engines["replicated"].url
    code, resp = post(url, body)
    assert code == status
    assert resp["error"]["param"] == param and resp["error"]["message"]
    assert complete(url, prompt=[1, 5])["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_and_models(engines, ckpt_a):
    url = engines["tp1"].url
    assert get(url, "/health") == (200, {"status": "ok"})
    code, models = get(url, "/v1/models")
    assert code == 200 and models["data"][0]["id"] == ckpt_a.name
    assert models["data"][0]["max_model_len"] == 256
    assert complete(url, prompt="w5", model=ckpt_a.name)["model"] == ckpt_a.name


@pytest.mark.parametrize("name", ["broadcast", "replicated"])
def test_idle_engine_does_not_spin(engines, name):
    procs = [psutil.Process(p.pid) for p in engines[name].procs]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(IDLE_WINDOW_S)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
    assert max(used) < IDLE_CPU_BUDGET_S, used


def test_sigterm_stops_cleanly_and_fails_in_flight_requests(launch_engine):
    """In-flight requests get an error response, every rank exits 0, within seconds."""
    engine = launch_engine("--random-preset", "small", "--max-context", "2048", "--control-plane", "broadcast")
    body = dict(prompt="hello", max_tokens=2000, temperature=0, ignore_eos=True)
    results = {"stream": []}

    def blocking():
        results["plain"] = post(engine.url, body)

    def streaming():
        stream(engine.url, body, events=results["stream"])

    threads = [threading.Thread(target=blocking, name="test-plain"), threading.Thread(target=streaming,
                                                                                      name="test-stream")]
    for t in threads:
        t.start()
    wait_for(lambda: len(results["stream"]) >= 3, 30, "streamed tokens")
    started = time.monotonic()
    engine.signal_all(signal.SIGTERM)
    codes = engine.wait(15)
    elapsed = time.monotonic() - started
    for t in threads:
        t.join(15)
    assert codes == [0, 0], [engine.stderr(r)[-2000:] for r in range(2)]
    assert elapsed < 10
    status, resp = results["plain"]
    assert status == 503 and "shutting down" in resp["error"]["message"]
    events = results["stream"]
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_cuda_without_a_gpu_exits_2(launch_engine):
    engine = launch_engine("--device", "cuda", nproc=1, ready=False)
    assert engine.wait(60) == [2]
    assert "--device cuda but CUDA device 0 is not available" in engine.stderr(0)
