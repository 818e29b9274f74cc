"""Socket activation against real engine processes (issue 21): the port outlives the engine.

The test plays the supervisor: it binds and listens once, passes the socket
to an engine (``pass_fds`` + ``SUPERVISE_LISTEN_FDS``), stops that engine
while the official ``openai`` client (default retries) has a request in
flight, sends requests while no engine runs (they connect at once: the
kernel queues them in the backlog), then starts a second engine on the same
socket the systemd way (fd 3, ``LISTEN_PID``/``LISTEN_FDS`` set by a wrapper
that then execs the engine): every waiting request is answered, and the
client's retry of its 503 completes on the second engine.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.conftest import MARK_VAR
from tests.engine.conftest import post, wait_for
from tp_supervise.engine.app import READY_PREFIX
from tp_supervise.engine.runfiles import read_inflight
from tp_supervise.supervisor.rank.net import listen_backlog

pytestmark = pytest.mark.e2e

WAITING_CLIENTS = 4
CONNECT_TIMEOUT_S = 2.0
ANSWER_TIMEOUT_S = 120.0
RETRIED_TOKENS = 1000
BODY = {"prompt": "waiting", "max_tokens": 4, "temperature": 0}


def send_request(port: int) -> tuple[http.client.HTTPConnection, float]:
    """Connect and send a completion request; returns the connection and how long connecting took."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CONNECT_TIMEOUT_S)
    conn.connect()
    took = time.monotonic() - started
    conn.sock.settimeout(ANSWER_TIMEOUT_S)
    conn.request("POST", "/v1/completions", body=json.dumps(BODY), headers={"Content-Type": "application/json"})
    return conn, took


@pytest.mark.slow
def test_engine_serves_on_an_inherited_socket_and_waiting_connections_survive_a_restart(launch_engine, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0), backlog=listen_backlog())
    port = listener.getsockname()[1]
    fd = listener.fileno()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        first = launch_engine(nproc=1, env={"SUPERVISE_LISTEN_FDS": str(fd), "SUPERVISE_RUN_DIR": str(run_dir)},
                              rank_fds={0: (fd,)})
        assert first.url == f"http://127.0.0.1:{port}"  # the inherited socket, not --port 0
        assert "inherited_socket=True" in first.stderr(0)
        status, body = post(first.url, BODY)
        assert status == 200 and body["usage"]["completion_tokens"] == 4

        # the official client, default retries, has a request in flight when the engine is stopped
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", timeout=ANSWER_TIMEOUT_S)
        retried: dict = {}
        caller = threading.Thread(target=lambda: retried.update(result=client.completions.create(
            model="random-tiny", prompt="retried", max_tokens=RETRIED_TOKENS, temperature=0,
            extra_body={"ignore_eos": True})), name="test-openai-client", daemon=True)
        caller.start()
        wait_for(lambda: read_inflight(run_dir / "inflight-rank0").fingerprints, 60, "the client's request to run")
        first.procs[0].send_signal(signal.SIGTERM)  # it answers 503 + Retry-After; the client retries
        assert first.procs[0].wait(30) == 0
        # no engine: connections still succeed at once and wait in the backlog
        waiting = [send_request(port) for _ in range(WAITING_CLIENTS)]
        assert max(took for _, took in waiting) < CONNECT_TIMEOUT_S

        second = start_systemd_style(listener, tmp_path, launch_engine.mark)
        try:
            for conn, _ in waiting:
                resp = conn.getresponse()
                body = json.loads(resp.read())
                assert resp.status == 200 and body["usage"]["completion_tokens"] == 4, body
                conn.close()
            out = wait_for(lambda: READY_PREFIX in second.out.read_text() and second.out.read_text(), 60,
                           "the second engine's ready line")
            assert f"http://127.0.0.1:{port}" in out
            caller.join(ANSWER_TIMEOUT_S)
            assert retried["result"].usage.completion_tokens == RETRIED_TOKENS  # served by the second engine
            assert "stopped serving" in first.stderr(0)
        finally:
            second.proc.kill()
            second.proc.wait(30)
    finally:
        listener.close()


class _Started:
    def __init__(self, proc: subprocess.Popen, out) -> None:
        self.proc = proc
        self.out = out


def start_systemd_style(listener: socket.socket, tmp_path, mark: str) -> _Started:
    """What systemd does between fork and exec: the socket on fd 3, ``LISTEN_PID`` = the pid, ``LISTEN_FDS=1``."""
    fd = listener.fileno()
    wrapper = ("import os, sys\n"
               f"os.dup2({fd}, 3)\nos.close({fd})\n"
               "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
               "os.execv(sys.executable, [sys.executable, '-m', 'tp_supervise.engine', '--port', '0'])\n")
    out, err = tmp_path / "systemd.out", tmp_path / "systemd.err"
    env = {**os.environ, MARK_VAR: mark, "RANK": "0", "WORLD_SIZE": "1"}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-c", wrapper], env=env, stdout=o, stderr=e, pass_fds=(fd,),
                                start_new_session=True)
    return _Started(proc, out)


def test_a_bad_inherited_fd_is_a_startup_error(launch_engine):
    r, w = os.pipe()
    try:
        engine = launch_engine(nproc=1, env={"SUPERVISE_LISTEN_FDS": str(r)}, rank_fds={0: (r,)}, ready=False)
        assert engine.wait(60) == [1]
        assert "cannot use the inherited socket: fd" in engine.stderr(0) and "is not a socket" in engine.stderr(0)
        assert "group failed" not in engine.stderr(0)  # a startup error, nothing was being served
    finally:
        os.close(r)
        os.close(w)
