"""Exact quarantine of co-arrivals (issue 21): requests that arrive with a poison request are not quarantined with it.

``supervise serve --tp 2 --max-restarts 3 --inject poison@1`` (rank 1 crashes
in every step that prefills a ``TPS_POISON`` prompt), with ``slow@0:1`` so
that every decode step lasts 200 ms: a long stream keeps the engine stepping,
and a burst sent during a step is drained and scheduled in one step, so the
co-arrival is made, not left to chance.  A poison request and three
innocent ones arrive together; the relay (supervisor/relay/) sends what was in
flight at a failure again, so the four come back together too:

* first failure: the four are scheduled in the failing step, all four are
  suspects (the bundle says so: otherwise the test tested nothing), and the
  supervisor lists them under ``suspects`` in ``quarantine.json``;
* second failure: the engine prefills each suspect alone in its step, so the
  failing step started only the poison request: it alone is a suspect, and
  it alone is quarantined.

The poison request is answered 400 ``request_quarantined`` and the three
innocent ones 200, in that same round, and again when sent afresh.  With the
scheduler ignoring ``isolate``, the second failing step starts the four
together again and all four are quarantined: this test fails.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.conftest import wait_no_marked
from tests.e2e.test_serving_through_faults import Served, serve
from tp_supervise.engine.inject import POISON_MARKER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of real time each: make test-slow

INNOCENT = 3
BACKGROUND_TOKENS = 400  # at 200 ms a step: longer than a round
RESTART_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 60.0


def post(port: int, prompt: str) -> tuple[int, dict]:
    body = json.dumps({"model": "random-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class Background:
    """One long stream (no retries) that keeps the engine stepping; ``started`` once its first chunk is out."""

    def __init__(self, port: int, name: str) -> None:
        self.started = threading.Event()
        self.stopping = threading.Event()
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                 timeout=REQUEST_TIMEOUT_S * 3)
        self.thread = threading.Thread(target=self._run, args=(name,), name="test-background", daemon=True)
        self.thread.start()

    def _run(self, name: str) -> None:
        try:
            for _ in self.api.completions.create(model="random-tiny", prompt=f"background {name}", stream=True,
                                                 max_tokens=BACKGROUND_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True}):
                self.started.set()
                if self.stopping.is_set():
                    break  # closes the stream: the engine aborts it
        except openai.APIError:
            pass
        finally:
            self.started.set()
            self.api.close()


def burst(port: int, prompts: list[str]) -> list[tuple[int, dict]]:
    """Send every prompt at once (one connection each); the answers in the prompts' order."""
    answers: list = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        gate.wait()
        answers[i] = post(port, prompts[i])

    threads = [threading.Thread(target=one, args=(i,), name=f"test-burst-{i}") for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 10)
    return answers


def co_arrive(served: Served, prompts: list[str], round_: int) -> list[tuple[int, dict]]:
    background = Background(served.port, f"round {round_}")
    assert background.started.wait(REQUEST_TIMEOUT_S), "the background stream never started"
    time.sleep(0.3)  # inside a 200 ms decode step: the burst waits for the next drain together
    answers = burst(served.port, prompts)
    background.stopping.set()
    background.thread.join(REQUEST_TIMEOUT_S)
    return answers


def test_only_the_poison_request_is_quarantined_when_innocent_requests_arrive_with_it_twice(tmp_path):
    served = serve(tmp_path, "--max-restarts", "3", "--inject", "poison@1", "--inject", "slow@0:1")
    poison = f"please {POISON_MARKER} now"
    prompts = [poison, *(f"innocent request {i}: the quick brown fox" for i in range(INNOCENT))]
    try:
        # two failures (the relay resent the four after the first); the answers come from the third attempt
        first = co_arrive(served, prompts, 1)
        after = [post(served.port, p) for p in prompts]
    finally:
        code = served.stop()
    leaked = wait_no_marked(served.mark, timeout=5.0)
    assert not leaked, f"processes leaked: {leaked}"
    assert code == 0, served.log_path.read_text()[-3000:]

    assert first[0][0] == 400 and first[0][1]["error"]["code"] == "request_quarantined", first[0]
    assert [s for s, _ in first[1:]] == [200] * INNOCENT, first[1:]
    bundles = served.bundles("rank_exit")
    assert len(bundles) == 2, [b["incident_id"] for b in bundles]
    suspects = [b["requests"]["suspects"] for b in bundles]
    # the co-arrival happened: the four shared the failing step of the first failure
    assert len(suspects[0]) == len(prompts), bundles[0]["requests"]
    # the second failing step started the poison request alone
    assert len(suspects[1]) == 1 and suspects[1][0] in suspects[0], bundles[1]["requests"]
    quarantined = served.events("request_quarantined")
    assert [q["fingerprint"] for q in quarantined] == suspects[1], quarantined

    status, body = after[0]
    assert status == 400 and body["error"]["code"] == "request_quarantined", after[0]
    assert [s for s, _ in after[1:]] == [200] * INNOCENT, after[1:]
    print(f"\nfirst failure: {len(suspects[0])} suspects; second: {len(suspects[1])}; "
          f"quarantined {len(quarantined)}")
