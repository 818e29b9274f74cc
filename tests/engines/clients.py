"""The clients of the real-engine tests that run behind the relay: the official ``openai`` SDK (default retries),
greedy requests of a fixed length whose text an uninterrupted run gives (so a stream the relay resumed across a
restart is compared with it), the relay's /readyz polled, one long stream cut on purpose."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import openai

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


def wait_served_after(run, clients: Clients, t: float) -> None:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while not clients.served_all_after(t):
        assert run.proc.poll() is None, run.stderr[-4000:]
        assert time.monotonic() < deadline, f"not every client was served again: {clients.errors}"
        time.sleep(1)
