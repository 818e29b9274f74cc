"""``--relay`` in front of a COMMAND's engine that is not vLLM: the ``openai`` adapter (no token ids), with the
built-in engine run as a COMMAND on its own port (it speaks OpenAI's API; the supervisor is told nothing else of
it).  A request held across the restart is answered; a stream that already sent tokens ends with an error event
naming the incident, never a silent cut; the relay's /readyz says the group is restarting and /livez stays 200.
Real vLLM behind the relay: tests/engines/test_vllm_relay.py."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from tests.support.serving import wait_serving
from tp_supervise.supervisor.rank.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

READY_TIMEOUT_S = 120.0


def post(port: int, body: dict, timeout: float = 120.0):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=timeout)


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def rank_pid(run, rank: int) -> int:
    for proc in psutil.Process(run.proc.pid).children():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == str(rank):
            return proc.pid
    raise AssertionError(f"no rank {rank}")


def test_an_engine_without_token_ids_behind_the_relay(supervise):
    up, pub = free_port(), free_port()
    engine = [sys.executable, "-m", "tp_supervise.engine", "--port", str(up), "--host", "127.0.0.1"]
    run = supervise(
        ["--nproc-per-node", "2", "--max-restarts", "1", "--relay", f"127.0.0.1:{pub}", "--relay-upstream",
         f"http://127.0.0.1:{up}"],
        engine,
        drain=True,
    )
    assert wait_serving(run.proc, pub, READY_TIMEOUT_S), run.stderr[-3000:]
    with post(pub, {"prompt": "hello", "max_tokens": 4}) as answer:
        assert json.loads(answer.read())["choices"][0]["text"] is not None
    assert status(pub, "/readyz") == 200 and status(pub, "/livez") == 200

    seen: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            seen.append((time.monotonic(), status(pub, "/readyz"), status(pub, "/livez")))
            time.sleep(0.2)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    stream = post(pub, {"prompt": "hello", "max_tokens": 256, "ignore_eos": True,
                        "stream": True})
    events = []
    for line in stream:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
        if len(events) == 3:
            break
    killed_at = time.monotonic()
    psutil.Process(rank_pid(run, 1)).send_signal(signal.SIGKILL)
    rest = [line for line in stream if line.startswith(b"data: ")]
    stream.close()
    # a request sent while the group is down is held and answered by the next attempt
    with post(pub, {"prompt": "held across the restart", "max_tokens": 4}) as answer:
        assert answer.status == 200
    stop.set()
    prober.join(10)
    deadline = time.monotonic() + 10
    while status(pub, "/readyz") != 200:  # the next attempt answers: ready again
        assert time.monotonic() < deadline, "the relay's /readyz did not turn 200 again"
        time.sleep(0.2)

    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 0, run.stderr[-3000:]
    assert run.events("relay serving")[0]["engine"] == "openai"
    assert rest and rest[-1].strip() == b"data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "engine_unavailable" and "incident" in error["message"], error
    given_up = run.events("request given up")
    assert given_up and "cannot continue" in given_up[0]["why"], given_up
    during = [(ready, live) for t, ready, live in seen if t > killed_at]
    assert any(ready == 503 for ready, _ in during), during
    assert all(live == 200 for _, live in during), during
