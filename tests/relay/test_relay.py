"""The relay (supervisor/relay/) as a real process, in front of a scripted upstream that plays rank 0.

The upstream here is a small aiohttp server in the test process on a socket the
test bound once (as the supervisor binds rank 0's), whose answers the test
scripts: a stream cut after some tokens (rank 0 SIGKILLed), the engine's own
503 ``engine_unavailable`` (its group failed), nobody accepting (a restart).
The relay is what is tested; the real engine behind it is covered by
tests/e2e/test_serving_through_faults.py and the resume extension by
tests/engine/test_engine_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from tp_supervise.engine.runfiles import read_inflight
from tp_supervise.supervisor.rank.net import listen_backlog
from tp_supervise.supervisor.relay.engines import request_fingerprint
from tp_supervise.supervisor.relay.protocol import RELAY_INFLIGHT_FILE, Notice

STREAM_TOKENS = 10
START_TIMEOUT_S = 30.0


class Upstream:
    """A scripted rank 0: ``plan`` is popped per generation request (default: answer in full)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=listen_backlog())
        self.port = self.sock.getsockname()[1]
        self.plan: list[str] = []
        self.script: dict[str, list[str]] = {}  # prompt -> its own steps, before the plan
        self.bodies: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        assert self._started.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        self._loop.run_until_complete(self.runner.setup())
        self.site = web.SockSite(self.runner, self.sock)
        self._loop.run_until_complete(self.site.start())
        self._started.set()
        self._loop.run_forever()

    async def health(self, _request):
        return web.json_response({"status": "ok"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        own = self.script.get(body.get("prompt"))
        step = own.pop(0) if own else self.plan.pop(0) if self.plan else "full"
        if step == "unavailable":
            error = {"message": "the engine's group failed (incident X); retry the request", "type": "server_error",
                     "param": None, "code": "engine_unavailable"}
            return web.json_response({"error": error}, status=503, headers={"Retry-After": "1"})
        if step == "quarantined":
            error = {"message": "this request is quarantined", "type": "invalid_request_error", "param": None,
                     "code": "request_quarantined"}
            return web.json_response({"error": error}, status=400)
        if step == "hold":
            await asyncio.sleep(3600)
        if step.startswith("wait-cut:"):  # queued in the engine this long, then its group dies
            await asyncio.sleep(float(step.split(":")[1]))
            request.transport.close()
            return web.Response()
        done = len(body.get("resume_token_ids") or [])
        cut = int(step.split(":")[1]) if step.startswith("cut:") else None
        fail = int(step.split(":")[1]) if step.startswith("fail:") else None
        unfinished = step == "no-done"  # every token and the finish, then the connection closes before [DONE]
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-up", "object": "text_completion", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "text": "x" * STREAM_TOKENS, "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(done, STREAM_TOKENS):
            if cut is not None and i == cut:
                request.transport.close()  # rank 0 died mid-stream: no [DONE], no error event
                return response
            if fail is not None and i == fail:  # rank 1 died: rank 0 ends the stream with the engine's error event
                error = {"message": "the engine's group failed (incident X); retry the request",
                         "type": "server_error", "param": None, "code": "engine_unavailable"}
                await response.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
                await response.write_eof()
                return response
            choice = {"index": 0, "text": f"t{i} ", "finish_reason": "length" if i == STREAM_TOKENS - 1 else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [100 + i]
            chunk = {"id": f"cmpl-{len(self.bodies)}", "object": "text_completion", "created": len(self.bodies),
                     "model": "m", "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if unfinished:
            await asyncio.sleep(0.2)  # the chunks reach the relay before the close
            request.transport.close()
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def start_relay(tmp_path, upstream: Upstream, *args: str) -> tuple[subprocess.Popen, int]:
    public = socket.create_server(("127.0.0.1", 0), backlog=listen_backlog())
    port = public.getsockname()[1]
    env = dict(os.environ, SUPERVISE_LISTEN_FDS=str(public.fileno()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tp_supervise.supervisor.relay", "--upstream", f"127.0.0.1:{upstream.port}",
         "--run-dir", str(tmp_path), *args],
        pass_fds=(public.fileno(),), env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    public.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if get(port, "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.1)
    return proc, port


def tell(proc: subprocess.Popen, notice: Notice) -> None:
    """What the supervisor tells the relay: a line on its stdin."""
    proc.stdin.write(notice.line())
    proc.stdin.flush()


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 10.0) -> None:
    """Until the relay's stderr has a line with ``text`` (read on a thread: a relay that never says it fails the
    test rather than hanging it)."""
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            if text.encode() in line:
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(timeout), f"the relay did not log {text!r}"


@pytest.fixture
def relay(tmp_path):
    upstream = Upstream()
    proc, port = start_relay(tmp_path, upstream)
    yield proc, port, upstream
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    upstream.close()


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(port: int, body: dict, path: str = "/v1/completions", timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def events(raw: bytes) -> list:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_failed_stream_continues_from_the_tokens_the_client_has(relay):
    _proc, port, upstream = relay
    # rank 1 dies (rank 0's error event), the next attempt fails at once (503), the one after fails mid-stream
    upstream.plan = ["fail:4", "unavailable", "fail:7"]
    status, raw = post(port, {"prompt": "p", "max_tokens": STREAM_TOKENS, "stream": True})
    assert status == 200
    got = events(raw)
    assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got), got
    chunks = got[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(f"t{i} " for i in range(STREAM_TOKENS))
    assert {c["id"] for c in chunks} == {"cmpl-1"} and {c["created"] for c in chunks} == {1}, "one stream"
    assert all("token_ids" not in c["choices"][0] for c in chunks), "ids only when the client asked"
    sent = upstream.bodies
    assert [b.get("resume_token_ids") for b in sent] == [None, [100, 101, 102, 103], [100, 101, 102, 103],
                                                        [100 + i for i in range(7)]]
    assert all(b["return_token_ids"] is True and b["prompt"] == "p" for b in sent)


def test_a_stream_cut_without_an_answer_continues_from_what_the_client_received(relay):
    """Rank 0 SIGKILLed: the connection closes mid-stream.  Chunks still in flight when it closed may be lost
    (aiohttp reports the broken payload before buffered lines); the client never saw them either, so the resend
    carries exactly the tokens relayed, and the text stays whole."""
    _proc, port, upstream = relay
    upstream.plan = ["cut:4", "cut:7"]
    status, raw = post(port, {"prompt": "p", "max_tokens": STREAM_TOKENS, "stream": True})
    got = events(raw)
    assert status == 200 and got[-1] == "[DONE]", got
    assert "".join(c["choices"][0]["text"] for c in got[:-1]) == "".join(f"t{i} " for i in range(STREAM_TOKENS))
    resumed = [b.get("resume_token_ids") or [] for b in upstream.bodies]
    assert len(resumed) >= 3 and resumed[0] == []
    assert all(r == [100 + i for i in range(len(r))] for r in resumed), resumed
    assert all(len(a) <= len(b) for a, b in zip(resumed, resumed[1:])), resumed


def test_token_ids_stay_when_the_client_asked_for_them(relay):
    _proc, port, upstream = relay
    upstream.plan = ["fail:3"]
    _status, raw = post(port, {"prompt": "p", "max_tokens": STREAM_TOKENS, "stream": True, "return_token_ids": True})
    ids = [i for e in events(raw)[:-1] for i in e["choices"][0]["token_ids"]]
    assert ids == [100 + i for i in range(STREAM_TOKENS)]


def test_a_request_answered_by_a_failing_group_is_sent_again_whole(relay):
    _proc, port, upstream = relay
    upstream.plan = ["unavailable", "unavailable"]
    status, raw = post(port, {"prompt": "p", "max_tokens": 4})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "x" * STREAM_TOKENS
    assert len(upstream.bodies) == 3 and all("resume_token_ids" not in b for b in upstream.bodies)


def test_a_refusal_is_passed_on_before_and_after_the_stream_began(relay):
    _proc, port, upstream = relay
    upstream.plan = ["quarantined"]
    status, raw = post(port, {"prompt": "p", "max_tokens": 4})
    assert status == 400 and json.loads(raw)["error"]["code"] == "request_quarantined"
    upstream.plan = ["fail:2", "quarantined"]
    status, raw = post(port, {"prompt": "p", "max_tokens": STREAM_TOKENS, "stream": True})
    got = events(raw)
    assert status == 200 and got[-1] == "[DONE]" and got[-2]["error"]["code"] == "request_quarantined", got


def test_requests_held_when_the_run_ends_get_a_503_naming_the_incident(relay):
    proc, port, upstream = relay
    upstream.plan = ["hold", "hold"]
    tell(proc, Notice(incident="20261201T000000Z-rank_exit"))  # the supervisor ruled it (its stdin, no file)
    results: dict = {}

    def send(kind: str, body: dict) -> None:
        results[kind] = post(port, body)

    threads = [threading.Thread(target=send, args=("unary", {"prompt": "p"})),
               threading.Thread(target=send, args=("stream", {"prompt": "p", "stream": True}))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(upstream.bodies) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    sent_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(15)
    assert time.monotonic() - sent_at < 5.0, "the relay answers what it holds at once"
    for kind in ("unary", "stream"):
        status, raw = results[kind]
        body = json.loads(raw)
        assert status == 503 and body["error"]["code"] == "engine_unavailable", (kind, status, raw)
        assert "20261201T000000Z-rank_exit" in body["error"]["message"]
    assert proc.wait(10) == 0


def test_health_of_a_group_that_does_not_answer_is_503(relay):
    _proc, port, upstream = relay
    assert get(port, "/health")[0] == 200
    asyncio.run_coroutine_threadsafe(upstream.site.stop(), upstream._loop).result(10)
    status, body = get(port, "/health")  # the upstream's socket is closed: connection refused
    assert status == 503 and json.loads(body)["status"] == "unavailable"


def test_a_client_that_leaves_is_not_sent_again(relay):
    _proc, port, upstream = relay
    upstream.plan = ["hold"]
    with socket.create_connection(("127.0.0.1", port)) as conn:
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while not upstream.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(1.0)
    assert len(upstream.bodies) == 1, upstream.bodies


def test_a_stream_cut_after_its_last_token_is_ended_not_resumed(relay):
    _proc, port, upstream = relay
    upstream.plan = ["no-done"]
    status, raw = post(port, {"prompt": "p", "max_tokens": STREAM_TOKENS, "stream": True})
    got = events(raw)
    assert status == 200 and got[-1] == "[DONE]", got
    finishes = [c["choices"][0]["finish_reason"] for c in got[:-1]]
    assert finishes.count("length") == 1 and finishes[-1] == "length", finishes
    assert len(upstream.bodies) == 1, "nothing left to resume"


def test_a_request_whose_client_left_during_a_restart_is_withdrawn(tmp_path):
    """While no attempt accepts, the relay's request waits in rank 0's backlog; when its client leaves, the relay
    closes that connection, so the next attempt reads a request whose sender is gone (never a live one)."""
    upstream = socket.create_server(("127.0.0.1", 0), backlog=16)  # nobody accepts: a restart
    public = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = public.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tp_supervise.supervisor.relay", "--upstream",
         f"127.0.0.1:{upstream.getsockname()[1]}", "--run-dir", str(tmp_path)],
        pass_fds=(public.fileno(),), env=dict(os.environ, SUPERVISE_LISTEN_FDS=str(public.fileno())),
        stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    public.close()
    try:
        body = json.dumps({"prompt": "p", "max_tokens": 4}).encode()
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        upstream.settimeout(30)
        held, _ = upstream.accept()  # the relay's connection, queued in the backlog (the test plays the new attempt)
        client.close()
        held.settimeout(10)
        data = b""
        while True:  # EOF within the timeout, not a connection left waiting for the next attempt's answer
            chunk = held.recv(65536)
            if not chunk:
                break
            data += chunk
        # the request, or nothing when the client left before the relay wrote it (a loaded host): closed either way
        assert data == b"" or (data.startswith(b"POST /v1/completions") and body in data), data[:200]
        held.close()
    finally:
        proc.kill()
        proc.wait(10)
        upstream.close()


def test_a_suspect_is_alone_until_the_engine_answers_its_first_token_however_long_it_waits(tmp_path):
    """A COMMAND's engine (the openai adapter: the relay records and quarantines).  Two suspects of the crash loop,
    neither streamed: the poison waits in the engine's queue for 3 s and then its group dies.  Until then nothing
    else was sent and only the poison is recorded, so the failure is blamed on it alone (a timer that ended its
    turn after 2 s once let the bystander's turn begin, and the bystander was blamed with it)."""
    upstream = Upstream()
    proc, port = start_relay(tmp_path, upstream, "--engine", "openai")
    try:
        poison = {"model": "m", "prompt": "poison", "max_tokens": 8}
        bystander = {"model": "m", "prompt": "bystander", "max_tokens": 8}
        fp = {b["prompt"]: request_fingerprint("/v1/completions", b) for b in (poison, bystander)}
        tell(proc, Notice(suspects=frozenset(fp.values())))
        wait_for_line(proc, "quarantine list received")
        upstream.script = {"poison": ["wait-cut:3"]}
        answers: dict[str, int] = {}

        def send(body: dict) -> None:
            answers[body["prompt"]] = post(port, body, timeout=60)[0]

        threads = [threading.Thread(target=send, args=(b,)) for b in (poison, bystander)]
        threads[0].start()
        deadline = time.monotonic() + 10
        while not upstream.bodies:
            assert time.monotonic() < deadline, "the poison was not sent"
            time.sleep(0.05)
        threads[1].start()
        time.sleep(2.5)  # past the old 2 s window, the poison still waits in the engine
        assert [(b["prompt"], b["max_tokens"]) for b in upstream.bodies] == [("poison", 1)], upstream.bodies
        recorded = read_inflight(tmp_path / RELAY_INFLIGHT_FILE).fingerprints
        assert recorded == (fp["poison"],), recorded
        for t in threads:
            t.join(60)
        assert answers == {"poison": 200, "bystander": 200}, answers
        sent = [(b["prompt"], b["max_tokens"]) for b in upstream.bodies]
        # each suspect alone through its first token (one-token request), then whole; the poison again after the
        # failure (the next attempt's turn is its own), the bystander only after the poison got past its prefill
        assert sent[:2] == [("poison", 1), ("poison", 1)], sent
        assert sent.index(("bystander", 1)) > sent.index(("poison", 1), 1), sent
        assert ("bystander", 8) in sent and all("stream" not in b for b in upstream.bodies if b["max_tokens"] == 1)
    finally:
        proc.kill()
        proc.wait(10)
        upstream.close()


def test_signals_while_the_relay_ends_are_not_a_traceback_or_a_death_by_signal(relay):
    # The supervisor closes the relay's stdin, then sends SIGTERM: a signal that came while asyncio closed its
    # loop printed "Exception ignored ... signal wakeup fd" to the run's log, and one after it killed the relay.
    proc, _port, _upstream = relay
    proc.stdin.close()
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    assert proc.wait(10) == 0
    stderr = proc.stderr.read().decode(errors="replace")
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]


def test_ctrl_c_alone_ends_the_relay_cleanly(relay):
    # A terminal's Ctrl-C reaches the whole foreground group, the relay included, maybe before the supervisor
    # closes its stdin: it ends as on SIGTERM (exit 0, its counts said), never with a KeyboardInterrupt.
    proc, _port, _upstream = relay
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    stderr = proc.stderr.read().decode(errors="replace")
    assert "relay stopped" in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_the_supervisor_counts_and_tells_the_relay_through_pipes_across_a_relay_restart(tmp_path):
    """The supervisor's side (RelayProcess) and the real relay: the counts come back over the counts pipe (no
    relay.json, nothing polled), summed over relay processes; an incident told over stdin reaches the 503 of a
    request held when the run ends, in a relay process started after it was told (the latest notice is told to
    every relay process)."""
    from tp_supervise.supervisor.processes.listen_socket import ListenSocket
    from tp_supervise.supervisor.relay.process import RelayProcess

    upstream = Upstream()
    public = ListenSocket.bind("127.0.0.1", 0, "--port")
    port = public.port
    relay = RelayProcess(public, f"127.0.0.1:{upstream.port}", str(tmp_path), "json", None, engine="builtin")
    fds = set(os.listdir("/proc/self/fd"))

    def counts_reach(**want: int) -> dict:
        deadline = time.monotonic() + 10
        while True:
            got = relay.counts()
            if all(got[k] == v for k, v in want.items()) or time.monotonic() > deadline:
                return got

    def serving(pid: int | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while relay.proc is None or relay.proc.pid == pid or get_or_none(port, "/livez") != 200:
            assert time.monotonic() < deadline, "the relay does not serve"
            time.sleep(0.1)

    try:
        relay.start()
        serving()
        assert post(port, {"prompt": "p", "max_tokens": 4})[0] == 200
        upstream.plan = ["unavailable"]  # the group's failure: resent, then answered
        assert post(port, {"prompt": "p", "max_tokens": 4})[0] == 200
        got = counts_reach(requests=2, resent=1)
        assert (got["requests"], got["resent"], got["given_up"], got["held"]) == (2, 1, 0, 0), got

        relay.tell("20261201T000000Z-rank_exit", {}, [])
        first = relay.proc.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not relay.pidfd.exited():
            assert time.monotonic() < deadline, "a SIGKILLed relay did not end"
            time.sleep(0.01)
        # What the supervisor's main loop does when its exit monitor reports the relay's death: reap it, and start it
        # again after the pause (told the incident again).
        assert relay.exited(time.monotonic()) is not None
        assert relay.respawn() is not None
        serving(first)
        assert post(port, {"prompt": "p", "max_tokens": 4})[0] == 200
        assert counts_reach(requests=3)["requests"] == 3, "the counts of both relay processes, summed"

        upstream.plan = ["hold"]
        held: dict = {}
        sender = threading.Thread(target=lambda: held.update(answer=post(port, {"prompt": "p", "max_tokens": 4})))
        sender.start()
        deadline = time.monotonic() + 10
        while len(upstream.bodies) < 5:
            assert time.monotonic() < deadline, "the held request did not reach the upstream"
            time.sleep(0.05)
        relay.stop()  # the run ends: what the relay holds gets its 503, naming the incident it was told
        sender.join(15)
        status, raw = held["answer"]
        assert status == 503 and "20261201T000000Z-rank_exit" in json.loads(raw)["error"]["message"], raw
        got = relay.counts()  # its last line, read at stop()
        assert (got["requests"], got["given_up"]) == (4, 1), got
        assert not (tmp_path / "relay.json").exists() and os.listdir(tmp_path) == [], os.listdir(tmp_path)
        assert set(os.listdir("/proc/self/fd")) <= fds, "the pipes are closed with the relay"
    finally:
        relay.stop()
        public.close()
        upstream.close()


def get_or_none(port: int, path: str) -> int | None:
    try:
        return get(port, path)[0]
    except OSError:
        return None
