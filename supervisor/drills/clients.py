"""The drill's clients: what a trial sends at the engine, through the relay, and when it was served again.

``Clients``: LOAD_THREADS clients cycling through the four ways a client asks (completion and chat, streamed and
not), a short probe every ``PROBE_EVERY_S`` whose answer times say when the engine served again, and, for the
soak, what production has and a drill does not.  Both drills use it (``builtin``, ``command``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

LOAD_THREADS = 4
REQUEST_TOKENS = 48
PROBE_EVERY_S = 0.25
REQUEST_TIMEOUT_S = 30.0


def request(port: int, path: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int | None, bytes]:
    """One POST: (status, body); status None when no answer came (refused, reset, timed out)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, repr(exc).encode()


def get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError, ValueError):
        return None, b""


def served_model(public: int) -> str | None:
    """The first model the engine lists (OpenAI servers want ``model`` in every request), or None."""
    status, body = get(public, "/v1/models")
    try:
        data = json.loads(body)["data"] if status == 200 else []
        return str(data[0]["id"]) if data else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


@dataclass
class Clients:
    """LOAD_THREADS clients cycling through the four ways a client asks (completion and chat, streamed and not;
    a stream counts only when it ends with ``data: [DONE]``), and a short probe every PROBE_EVERY_S whose answer
    times say when the engine served again.  ``soak`` adds what production has and a drill does not: long
    prompts, bursts, idle spells and streams the client walks away from."""

    port: int
    model: str | None = None
    timeout_s: float = REQUEST_TIMEOUT_S
    soak: bool = False
    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # (sent, answered, ok), wall clock
    errors: list[str] = field(default_factory=list)
    streams_cut: int = 0
    served: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Clients:
        for i in range(LOAD_THREADS):
            self._threads.append(threading.Thread(target=self._load, args=(i,), name=f"drill-load-{i}", daemon=True))
        self._threads.append(threading.Thread(target=self._probe, name="drill-probe", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _body(self, chat: bool, prompt: str, tokens: int, stream: bool) -> tuple[str, dict]:
        body: dict = {"max_tokens": tokens, "temperature": 0, "stream": stream}
        if self.model is not None:
            body["model"] = self.model
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        body["ignore_eos"] = True
        return "/v1/completions", body

    def _load(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"drill {worker}.{n}"
            tokens = REQUEST_TOKENS
            if self.soak:
                if n % 7 == 0:
                    prompt += " " + "and then the story went on " * 40  # a long prompt
                if n % 29 == 0:  # an idle spell
                    self._stop.wait(20.0)
                    continue
                if n % 11 == 0:
                    self._walk_away(prompt)
                    continue
            path, body = self._body(chat=n % 2 == 0, prompt=prompt, tokens=tokens, stream=n % 4 >= 2)
            status, answer = request(self.port, path, body, self.timeout_s)
            self._count(status, answer, body["stream"])
            if status != 200:
                self._stop.wait(1.0)
            elif self.soak and n % 13 == 0:  # a burst: no pause for a while, then a pause
                self._stop.wait(3.0)

    def _walk_away(self, prompt: str) -> None:
        """A streamed request the client drops after its first chunk (not an error: the client left)."""
        path, body = self._body(chat=False, prompt=prompt, tokens=200, stream=True)
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.readline()
        except (urllib.error.URLError, OSError, ValueError):
            pass

    def _count(self, status: int | None, answer: bytes, stream: bool) -> None:
        if self._stop.is_set():
            return  # the answers to the drill's own SIGTERM are not the fault's
        if status != 200:
            self.errors.append(f"{status} {answer[:200].decode(errors='replace')}")
        elif stream and b"data: [DONE]" not in answer:
            self.streams_cut += 1
        else:
            self.served += 1

    def _probe(self) -> None:
        n = 0
        while not self._stop.wait(PROBE_EVERY_S):
            n += 1
            sent = time.time()
            path, body = self._body(chat=False, prompt=f"probe {n}", tokens=2, stream=False)
            status, answer = request(self.port, path, body, self.timeout_s)
            self._count(status, answer, False)
            self.probes.append((sent, time.time(), status == 200))

    def served_after(self, at: float) -> float | None:
        """When the first probe answered 200 after ``at`` (wall clock), or None."""
        return min((done for _sent, done, ok in self.probes if ok and done > at), default=None)

    def wait_served_after(self, at: float, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            done = self.served_after(at)
            if done is not None:
                return done
            time.sleep(0.2)
        return None
