"""Engine Prometheus adapters against real HTTP servers (threads and a separate process)."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import wsgiref.simple_server
from contextlib import contextmanager

import prometheus_client as pc
import pytest

from tp_supervise.watchdogs.adapters import SGLANG, VLLM, PrometheusProgress, parse_progress
from tp_supervise.watchdogs.policy import VerdictKind, WatchdogConfig, WatchdogState, observe
from tp_supervise.watchdogs.progress import ExternalProgress

SCRAPE_TIMEOUT = 0.5
# Generous: a scrape is bounded by about twice its timeout; the machine is shared.
SCRAPE_BOUND = 10 * SCRAPE_TIMEOUT


POLL = 0.05  # server shutdown latency


class QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, *args):
        pass


@contextmanager
def exposition(registry: pc.CollectorRegistry):
    """prometheus_client's own exposition app behind a real WSGI server on a free port."""
    server = wsgiref.simple_server.make_server(
        "127.0.0.1", 0, pc.make_wsgi_app(registry), handler_class=QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, args=(POLL,), name="test-exposition", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def raw_server(body: bytes, status: int = 200, content_type: str = "text/plain; version=0.0.4"):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(POLL,), name="test-metrics-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def vllm_registry():
    reg = pc.CollectorRegistry()
    tokens = pc.Counter("vllm:generation_tokens", "Number of generation tokens processed.", ["model_name", "engine"], registry=reg)
    running = pc.Gauge("vllm:num_requests_running", "Requests running.", ["model_name", "engine"], registry=reg)
    return reg, tokens, running


def timed_scrape(source: PrometheusProgress) -> tuple[ExternalProgress, float]:
    t0 = time.monotonic()
    result = source.scrape()
    return result, time.monotonic() - t0


def test_vllm_families_summed_over_label_sets():
    reg, tokens, running = vllm_registry()
    tokens.labels("m", "0").inc(100)
    tokens.labels("m", "1").inc(23)
    running.labels("m", "0").set(2)
    running.labels("m", "1").set(1)
    with exposition(reg) as url:
        src = PrometheusProgress(url, engine="vllm", timeout=SCRAPE_TIMEOUT)
        first = src.scrape()
        assert first == ExternalProgress(tokens_total=123.0, running=3.0, ok=True)
        tokens.labels("m", "1").inc(7)
        running.labels("m", "0").set(0)
        assert src.scrape() == ExternalProgress(tokens_total=130.0, running=1.0, ok=True)


def test_sglang_families_with_tp_rank_labels():
    reg = pc.CollectorRegistry()
    tokens = pc.Counter("sglang:generation_tokens", "gen", ["model_name", "tp_rank"], registry=reg)
    running = pc.Gauge("sglang:num_running_reqs", "running", ["model_name", "tp_rank"], registry=reg)
    for r in range(2):
        tokens.labels("m", str(r)).inc(50)
        running.labels("m", str(r)).set(4)
    with exposition(reg) as url:
        got = PrometheusProgress(url, engine="auto", timeout=SCRAPE_TIMEOUT).scrape()
        assert got.ok and got.tokens_total == 100.0 and got.running == 8.0
        wrong = PrometheusProgress(url, engine="vllm", timeout=SCRAPE_TIMEOUT).scrape()
        assert not wrong.ok and "vllm:generation_tokens_total" in wrong.error


def test_environment_proxy_is_not_used(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    reg, tokens, running = vllm_registry()
    tokens.labels("m", "0").inc(1)
    running.labels("m", "0").set(0)
    with exposition(reg) as url:
        assert PrometheusProgress(url, timeout=SCRAPE_TIMEOUT).scrape().ok


@pytest.mark.parametrize(
    "body, text",
    [
        (b"<html><body>Not the metrics you want</body></html>", "unparsable"),
        (b"vllm:generation_tokens_total not-a-number\n", "unparsable"),
        (bytes(range(256)) * 4, "unparsable"),
        (b"# HELP up ok\n# TYPE up gauge\nup 1\n", "metrics lack"),
        (b"", "metrics lack"),
    ],
)
def test_garbage_bodies_are_reported_not_raised(body, text):
    with raw_server(body) as url:
        got = PrometheusProgress(url, timeout=SCRAPE_TIMEOUT).scrape()
    assert not got.ok and text in got.error


def test_http_error_status():
    with raw_server(b"boom", status=500) as url:
        got = PrometheusProgress(url, timeout=SCRAPE_TIMEOUT).scrape()
    assert not got.ok and "HTTP 500" in got.error


def test_server_that_never_answers_times_out():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # connections queue in the backlog; nobody ever reads or answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
        got, took = timed_scrape(PrometheusProgress(url, timeout=SCRAPE_TIMEOUT))
    finally:
        listener.close()
    assert not got.ok and "timed out" in got.error.lower()
    assert SCRAPE_TIMEOUT * 0.9 <= took < SCRAPE_BOUND


def test_not_http_at_all():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def babble():
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"\x00\xffSSH-2.0-not-http\r\n\r\n")

    t = threading.Thread(target=babble, name="test-babble", daemon=True)
    t.start()
    try:
        got = PrometheusProgress(f"http://127.0.0.1:{listener.getsockname()[1]}/m", timeout=SCRAPE_TIMEOUT).scrape()
    finally:
        t.join(timeout=5)
        listener.close()
    assert not got.ok and got.error


def test_connection_refused():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    got = PrometheusProgress(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT).scrape()
    assert not got.ok and "Connection" in got.error


def test_constructor_validation():
    with pytest.raises(ValueError, match="unknown engine"):
        PrometheusProgress("http://127.0.0.1:1/metrics", engine="trtllm")
    with pytest.raises(ValueError, match="timeout"):
        PrometheusProgress("http://127.0.0.1:1/metrics", timeout=0)
    with pytest.raises(ValueError, match="http"):
        PrometheusProgress("file:///etc/passwd")


def test_parse_progress_names():
    assert VLLM.tokens == ("vllm:generation_tokens_total",) and VLLM.running == ("vllm:num_requests_running",)
    assert SGLANG.tokens == ("sglang:generation_tokens_total",) and "sglang:num_running_reqs" in SGLANG.running
    text = "sglang:num_requests_running 2\nsglang:generation_tokens_total 9\n"
    assert parse_progress(text) == ExternalProgress(9.0, 2.0, True)
    # Untyped exposition (no TYPE lines), NaN members skipped.
    text = 'vllm:generation_tokens_total{engine="0"} 5\nvllm:generation_tokens_total{engine="1"} NaN\nvllm:num_requests_running 0\n'
    assert parse_progress(text) == ExternalProgress(5.0, 0.0, True)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import prometheus_client as pc
    reg = pc.CollectorRegistry()
    tokens = pc.Counter("vllm:generation_tokens", "gen", ["model_name"], registry=reg)
    running = pc.Gauge("vllm:num_requests_running", "running", ["model_name"], registry=reg)
    running.labels("tiny").set(3)
    server, _ = pc.start_http_server(0, addr="127.0.0.1", registry=reg)
    def decode():
        while True:
            tokens.labels("tiny").inc(3)
            time.sleep(0.02)
    threading.Thread(target=decode, name="decode", daemon=True).start()
    print(server.server_port, flush=True)
    sys.stdin.read()  # exit when the test closes our stdin
    """
)


def test_engine_process_progress_then_frozen_frontend():
    """A separate 'engine' process: tokens move; SIGSTOP it and scrapes time out; the policy sees a stall."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        src = PrometheusProgress(f"http://127.0.0.1:{port}/metrics", engine="vllm", timeout=SCRAPE_TIMEOUT)
        a = src.scrape()
        time.sleep(0.2)
        b = src.scrape()
        assert a.ok and b.ok and a.running == 3.0 and b.tokens_total > a.tokens_total

        config = WatchdogConfig(soft_timeout=1.0, hard_timeout=2.0, startup_timeout=60.0)
        state = WatchdogState.initial(0.0)
        state, v = observe(state, [], 0.1, config, a)
        state, v = observe(state, [], 0.2, config, b)
        assert v.kind is VerdictKind.OK

        os.kill(proc.pid, signal.SIGSTOP)
        frozen, took = timed_scrape(src)
        assert not frozen.ok and took < SCRAPE_BOUND
        state, v = observe(state, [], 1.3, config, frozen)
        assert v.kind is VerdictKind.SOFT
        state, v = observe(state, [], 2.3, config, frozen)
        assert v.kind is VerdictKind.HARD
        assert "engine metrics unavailable" in v.message

        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + SCRAPE_BOUND * 4
        # Resumed, the engine answers scrapes before its decode thread has run again: recovery is
        # tokens moving past the last reading, so wait for that (a loaded host saw an equal count: HUNG).
        again = src.scrape()
        while not (again.ok and again.tokens_total > b.tokens_total) and time.monotonic() < deadline:
            time.sleep(0.02)
            again = src.scrape()
        assert again.ok and again.tokens_total > b.tokens_total
        state, v = observe(state, [], 2.4, config, again)
        assert v.kind is VerdictKind.RECOVERED
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
