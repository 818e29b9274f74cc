"""Serving through faults, engine side (issue 21), on real ranks and real sockets.

* A peer SIGKILLed mid-request: every request in flight on rank 0 gets a 503
  with Retry-After naming the incident (streams: an error event, then
  ``[DONE]``), never a reset; the in-flight file still lists them after
  rank 0 died.
* SIGTERM while rank 0 is blocked in a collective (its peer is stopped): the
  clients are answered at once, not after the hard-exit grace.
* The frontend alone (no engine loop): a failed group turns ``/health`` to
  503 for good and names the incident the supervisor writes a moment late.
* In-flight fingerprints while a request runs; a quarantined fingerprint is a
  400 naming the incidents, re-read when the list changes.
* ``poison@1``: only the request carrying the marker crashes rank 1.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engine.conftest import post, wait_for
from tp_supervise.engine.inject import POISON_MARKER
from tp_supervise.engine.runfiles import fingerprint, read_inflight, write_quarantine
from tp_supervise.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.e2e

INCIDENT = "20260101T000000Z-rank_exit-r1"
LONG = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
CLIENT_TIMEOUT_S = 60.0
ANSWER_WITHIN_S = 2.0  # SIGTERM -> 503, while the engine loop is stuck (the hard exit comes at 5 s)


class Call:
    """One HTTP request in a thread: status, headers, JSON body or SSE events, or the exception it raised."""

    def __init__(self, port: int, path: str, body: dict):
        self.status: int | None = None
        self.headers: dict = {}
        self.body = None
        self.events: list = []
        self.error: BaseException | None = None
        self.answered_at: float | None = None
        self._args = (port, path, body)
        self.thread = threading.Thread(target=self._run, name=f"test-call-{path}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        port, path, body = self._args
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status, self.headers = resp.status, {k.lower(): v for k, v in resp.getheaders()}
            if self.headers.get("content-type", "").startswith("text/event-stream"):
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        payload = line[len("data: "):]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
            else:
                self.body = json.loads(resp.read())
            self.answered_at = time.monotonic()
        except BaseException as exc:  # a reset or an empty body is what the test must not see
            self.error = exc
        finally:
            conn.close()

    def join(self) -> Call:
        self.thread.join(CLIENT_TIMEOUT_S)
        assert not self.thread.is_alive()
        return self


def port_of(engine) -> int:
    return int(engine.url.rsplit(":", 1)[1])


def assert_unavailable(call: Call, *needles: str) -> None:
    assert call.error is None, repr(call.error)
    if call.events:  # a stream: 200 already sent, then an error event and [DONE]
        assert call.events[-1] == "[DONE]", call.events[-3:]
        error = call.events[-2]["error"]
    else:
        assert call.status == 503 and call.headers.get("retry-after") == "1", (call.status, call.headers)
        assert call.headers.get("connection") == "close"
        error = call.body["error"]
    assert error["type"] == "server_error"
    for needle in needles:
        assert needle in error["message"], error


def byte_fingerprint(model: str, prompt: str, **gen) -> str:
    args = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": None, "stop": (), "ignore_eos": False,
            **gen}
    return fingerprint(model, ByteTokenizer().encode(prompt), **args)


def test_peer_killed_fails_every_request_in_flight_with_503(launch_engine, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    engine = launch_engine("--random-preset", "small", "--max-context", "2048", env={"SUPERVISE_RUN_DIR": str(run_dir)})
    port = port_of(engine)
    calls = [Call(port, "/v1/completions", {"prompt": f"plain {i}", **LONG}) for i in range(2)]
    calls += [Call(port, "/v1/completions", {"prompt": "stream", "stream": True, **LONG}),
              Call(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "chat"}],
                                                  "stream": True, **LONG})]
    inflight = run_dir / "inflight-rank0"
    wait_for(lambda: inflight.exists() and len(read_inflight(inflight).fingerprints) == 4
             and len(calls[2].events) >= 3 and len(calls[3].events) >= 3, 60, "four requests running")
    (run_dir / "incident").write_text(INCIDENT + "\n")  # what the supervisor writes when it rules the fault
    engine.procs[1].send_signal(signal.SIGKILL)
    for call in calls:
        assert_unavailable(call.join(), "the engine's group failed", INCIDENT)
    assert engine.wait(30)[0] == 1
    assert "group failed" in engine.stderr(0) and "in_flight=4" in engine.stderr(0)
    after = read_inflight(inflight)  # written by a rank that is gone: still the four requests
    gen = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    expected = {byte_fingerprint("random-small", f"plain {i}", **gen) for i in range(2)}
    expected.add(byte_fingerprint("random-small", "stream", **gen))
    expected.add(byte_fingerprint("random-small", "user: chat\nassistant: ", **gen))
    assert set(after.fingerprints) == expected and after.pid == engine.procs[0].pid


def test_sigterm_while_blocked_in_a_collective_answers_at_once(launch_engine):
    engine = launch_engine("--inject", "stop@1:20")
    port = port_of(engine)
    health = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)  # keep-alive, opened now
    health.request("GET", "/health")
    resp = health.getresponse()
    assert resp.status == 200 and resp.read()
    calls = [Call(port, "/v1/completions", {"prompt": "blocked", **LONG}),
             Call(port, "/v1/completions", {"prompt": "blocked", "stream": True, **LONG})]
    wait_for(lambda: (Path(f"/proc/{engine.procs[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"),
             60, "rank 1 stopped by its injection")
    time.sleep(0.5)  # rank 0 is now inside an all-reduce that never completes
    sent = time.monotonic()
    engine.procs[0].send_signal(signal.SIGTERM)
    for call in calls:
        assert_unavailable(call.join(), "engine is shutting down")
        assert call.answered_at - sent < ANSWER_WITHIN_S
    health.request("GET", "/health")
    resp = health.getresponse()
    assert resp.status == 503 and json.loads(resp.read())["status"] == "shutting_down"
    health.close()
    assert engine.procs[0].wait(30) == 1  # the loop never came back: the guard's hard exit


def test_failed_group_frontend_health_and_late_incident(tmp_path):
    """The frontend alone: requests wait in the bridge (no engine loop drains it) when the group fails."""
    from tp_supervise.engine.bridge import EngineBridge
    from tp_supervise.engine.server import Frontend, FrontendSpec, group_failed_message

    assert group_failed_message(None) == "the engine's group failed; retry the request"  # no supervisor

    bridge = EngineBridge()
    frontend = Frontend(bridge, ByteTokenizer(), FrontendSpec(model_name="m", max_context=64, vocab_size=258,
                                                              host="127.0.0.1", port=0, seed=0,
                                                              run_dir=str(tmp_path)))
    port = frontend.start()
    try:
        health = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
        health.request("GET", "/health")
        resp = health.getresponse()
        assert resp.status == 200 and resp.read()
        calls = [Call(port, "/v1/completions", {"prompt": "x"}),
                 Call(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "stream": True})]
        wait_for(lambda: bridge.in_flight == 2, 10, "two requests in the bridge")
        late = threading.Timer(0.2, lambda: (tmp_path / "incident").write_text(INCIDENT))
        late.start()  # the supervisor rules the fault a moment after the collective failed
        frontend.fail_group("RuntimeError: Connection closed by peer")
        for call in calls:
            assert_unavailable(call.join(), "the engine's group failed", INCIDENT)
        health.request("GET", "/health")
        resp = health.getresponse()
        assert resp.status == 503 and json.loads(resp.read()) == {
            "status": "failed", "error": f"the engine's group failed (incident {INCIDENT}); retry the request"}
        with pytest.raises(OSError):  # no longer accepting (an inherited socket would queue it instead)
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).connect()
        health.close()
    finally:
        frontend.stop()


def test_inflight_fingerprint_and_quarantine(launch_engine, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    engine = launch_engine("--random-preset", "small", "--max-context", "2048", nproc=1,
                           env={"SUPERVISE_RUN_DIR": str(run_dir)})
    body = {"prompt": "the same request", "max_tokens": 1500, "temperature": 0.5, "seed": 3, "ignore_eos": True}
    fp = byte_fingerprint("random-small", "the same request", max_tokens=1500, temperature=0.5, seed=3,
                          ignore_eos=True)
    inflight = run_dir / "inflight-rank0"
    assert read_inflight(inflight).fingerprints == ()
    request = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as resp:
        assert resp.readline().startswith(b"data: ")
        wait_for(lambda: read_inflight(inflight).fingerprints == (fp,), 30, "the request's fingerprint in flight")
        assert "the same request" not in inflight.read_bytes().decode("latin-1")
    wait_for(lambda: read_inflight(inflight).fingerprints == (), 30, "the aborted request to leave")
    status, resp = post(engine.url, {**body, "max_tokens": 4})
    assert status == 200 and read_inflight(inflight).fingerprints == ()  # finished: no longer in flight

    write_quarantine(run_dir, {fp: ["inc-1", "inc-2"]})
    status, resp = post(engine.url, body)
    assert status == 400 and resp["error"]["code"] == "request_quarantined", resp
    assert "inc-1, inc-2" in resp["error"]["message"]
    status, resp = post(engine.url, {**body, "stream": True})
    assert status == 400 and resp["error"]["code"] == "request_quarantined"
    status, resp = post(engine.url, {**body, "seed": 4, "max_tokens": 4})  # another request is served
    assert status == 200, resp
    write_quarantine(run_dir, {})
    status, resp = post(engine.url, {**body, "max_tokens": 4})
    assert status == 200, resp
    assert "request quarantined" in engine.stderr(0) and "the same request" not in engine.stderr(0)


def test_poison_crashes_rank_1_only_for_the_marked_request(launch_engine, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    engine = launch_engine("--inject", "poison@1", "--control-plane", "replicated",
                           env={"SUPERVISE_RUN_DIR": str(run_dir)})
    for body, path in (({"prompt": "harmless", "max_tokens": 4}, "/v1/completions"),
                       ({"messages": [{"role": "user", "content": "TPS_POIS0N lookalike"}], "max_tokens": 4},
                        "/v1/chat/completions")):
        status, resp = post(engine.url, body, path=path)
        assert status == 200, resp
    port = port_of(engine)
    innocent = Call(port, "/v1/completions", {"prompt": "innocent", "stream": True, **LONG})
    wait_for(lambda: len(innocent.events) >= 3, 60, "the innocent stream to run")
    poison = Call(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"a {POISON_MARKER} b"}],
                                                 "max_tokens": 8, "temperature": 0})
    assert engine.wait(30) == [1, 1]
    assert f"InjectedFault: injected poison on rank 1: a scheduled prompt carries {POISON_MARKER}" in engine.stderr(1)
    assert "InjectedFault" not in engine.stderr(0)
    assert_unavailable(poison.join(), "the engine's group failed")
    assert_unavailable(innocent.join(), "the engine's group failed")
    marked = byte_fingerprint("random-tiny", f"user: a {POISON_MARKER} b\nassistant: ", max_tokens=8,
                              temperature=0.0)
    assert marked in read_inflight(run_dir / "inflight-rank0").fingerprints
