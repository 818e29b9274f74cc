"""The built-in engine under load, out-of-band consensus on: caught at the step it diverges.

Real engine ranks (gloo, TP=2) record their decisions through supervisor.rank.consensus;
the monitor reads the rings as the supervisor does.  The step the engine
diverged at is read from its own injection log line.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import uuid

import pytest

from tp_supervise.supervisor.rank.channel import rank_env
from tp_supervise.consensus.monitor import ConsensusMonitor
from tp_supervise.engine.launch import LaunchSpec, LocalEngine
from tests.conftest import MARK_VAR, wait_no_marked

pytestmark = pytest.mark.e2e

POLL_S = 0.005
REQUESTS = 6
TOKENS = 40
INJECT_LINE = re.compile(r"inject: diverging (?:token|batch).*?step=(\d+)")


def _complete(url: str, i: int) -> None:
    body = json.dumps({"prompt": f"hello {i}", "max_tokens": TOKENS, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except OSError:
        pass  # a diverged batch aborts a rank: in-flight requests fail


def serve_under_load(tmp_path, plane: str, inject: str | None):
    """Run the engine through REQUESTS concurrent completions; return (verdicts, monitor, engine)."""
    mark = uuid.uuid4().hex
    args = ["--port", "0", "--control-plane", plane]
    if inject:
        args += ["--inject", inject]
    spec = LaunchSpec(
        2, tuple(args), env={MARK_VAR: mark}, rank_env={r: rank_env(tmp_path, r, "observe") for r in range(2)}
    )
    engine = LocalEngine(spec, tmp_path / "logs")
    monitor = ConsensusMonitor(tmp_path, 2)
    verdicts: list = []
    stop = threading.Event()

    def poll():
        while not stop.wait(POLL_S):
            verdicts.extend(monitor.poll(time.monotonic()))

    poller = threading.Thread(target=poll, name="consensus", daemon=True)
    try:
        engine.start()
        url = engine.wait_ready()
        poller.start()
        clients = [threading.Thread(target=_complete, args=(url, i)) for i in range(REQUESTS)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        time.sleep(0.2)
    finally:
        stop.set()
        if poller.is_alive():
            poller.join()
        engine.kill()
        assert not wait_no_marked(mark, timeout=5.0)
    return verdicts, monitor, engine


@pytest.mark.parametrize("plane", ["broadcast", "replicated"])
def test_no_divergence_without_injection(tmp_path, plane):
    verdicts, monitor, _engine = serve_under_load(tmp_path, plane, None)
    c = monitor.counters()
    assert verdicts == [] and c.mismatches == 0
    assert c.comparisons >= TOKENS and c.entries_lost == 0


@pytest.mark.parametrize(
    ("plane", "kind", "in_progress"),
    [("replicated", "diverge_token", False), ("replicated", "diverge_batch", True), ("broadcast", "diverge_token", False)],
)
def test_injected_divergence_is_caught_at_its_step(tmp_path, plane, kind, in_progress):
    verdicts, _monitor, engine = serve_under_load(tmp_path, plane, f"{kind}@1:5")
    match = INJECT_LINE.search(engine.stderr(1))
    assert match, engine.stderr(1)[-2000:]
    assert verdicts, "no divergence reported"
    v = verdicts[0]
    assert v.step == int(match.group(1)) and v.culprit_ranks == (1,)
    if in_progress:  # the step never ends; a token divergence may be seen either way
        assert v.in_progress
    assert v.first_difference is not None and v.first_difference.kinds[1] == ("batch" if in_progress else "tokens")
    assert "no majority in a two-way split" in v.verdict
