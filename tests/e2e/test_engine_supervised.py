"""The built-in engine under `supervise serve`, with real completion load.

Issue 4: stop and hang_collective under decode load are hangs (exit 81,
culprit rank 1); slow is not.  Issue 5: the flight recorder shows rank 1
missing from the collective rank 0 entered.  Issue 6: injected divergences are
caught at their step (exit 82, never 81) and an uninjected run reports none.
Issue 3: SIGTERM with requests in flight exits 0 and answers every request.

Every run drives concurrent requests from threads on loopback, each request
and the whole load bounded in time; timeouts are generous (this runs on a
shared 2-core machine): timing goals live in bench/bench_detection.py.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tp_supervise.engine.inject import SLOW_STEP_DELAY_S as SLOW_STEP_S
from tp_supervise.supervisor.rank.net import free_port
from tests.live import http_get, metric_value, wait_for, wait_registry

pytestmark = pytest.mark.e2e

VOCAB = 258  # the default random model's byte vocabulary
FAULT_STEP = 40  # decode steps: several requests complete before the fault
READY_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 30.0
LOAD_THREADS = 4
MAX_TOKENS = 16
EXIT_TIMEOUT_S = 90.0
HANG_TIMEOUTS = ["--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"]
# slow@1 sleeps 0.2 s per step on rank 1; these are 20x and 40x that.
SLOW_TIMEOUTS = ["--soft-timeout", "4", "--hard-timeout", "8"]
SLOW_OBSERVE_S = 12.0
CLEAN_OBSERVE_S = 20.0


@dataclass
class Load:
    """Completion requests from threads until stopped; every request bounded by a client timeout.

    Outcomes: ("ok", tokens) for a 200 with a complete body, ("http", status)
    for an error response, ("conn", error) for a refused or reset connection,
    ("timeout", error) when the server never answered in time (a hang).
    """

    port: int
    threads: int = LOAD_THREADS
    max_tokens: int = MAX_TOKENS
    timeout_s: float = REQUEST_TIMEOUT_S
    outcomes: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "Load":
        for i in range(self.threads):
            t = threading.Thread(target=self._loop, args=(i,), name=f"test-load-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def one(self, prompt: str) -> tuple:
        body = json.dumps({"prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                           "temperature": 0, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                out = json.loads(resp.read())
            return ("ok", len(out["choices"][0]["token_ids"]))
        except urllib.error.HTTPError as exc:
            return ("http", exc.code)
        except (TimeoutError, socket.timeout) as exc:
            return ("timeout", repr(exc))
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                return ("timeout", repr(exc))
            return ("conn", repr(exc))
        except (ConnectionError, OSError, ValueError) as exc:  # reset mid-body, truncated JSON
            return ("conn", repr(exc))

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            outcome = self.one(f"request {i}.{n} under load")
            n += 1
            with self._lock:
                self.outcomes.append(outcome)
            if outcome[0] != "ok":
                self._stop.wait(0.2)

    def stop(self, join_s: float = REQUEST_TIMEOUT_S + 10) -> list:
        self._stop.set()
        for t in self._workers:
            t.join(join_s)
        assert not any(t.is_alive() for t in self._workers), "a load thread is stuck"
        return self.outcomes

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o[0] == kind)


def serve(supervise, *args: str):
    """Start the built-in engine under supervision on a free port; return (run, port) once it serves."""
    port = free_port()
    run = supervise(["--tp", "2", "--port", str(port), *args])

    def healthy():
        if run.proc.poll() is not None:
            raise AssertionError(f"supervise exited early ({run.proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_for(healthy, READY_TIMEOUT_S, interval=0.2, what="the engine to serve")
    except AssertionError:
        if run.proc.poll() is None:
            run.proc.kill()
        run.wait(timeout=30)
        raise AssertionError(f"engine never served\n{run.stderr[-4000:]}") from None
    return run, port


def fatal_bundles(run) -> list[Path]:
    return [b for b in run.bundles() if "hang_suspected" not in b.name]


def hang_bundle(run) -> Path:
    hangs = [b for b in run.bundles() if b.name.endswith("-hang") or "-hang-" in b.name]
    assert hangs, f"no hang bundle in {[b.name for b in run.bundles()]}\n{run.stderr[-3000:]}"
    return hangs[-1]


def metrics_url(tmp_path: Path) -> str:
    return wait_registry(tmp_path / "registry")["metrics"]


def terminate(run, timeout_s: float = 30.0) -> tuple[int, float]:
    """SIGTERM the supervisor; (exit code, seconds until it exited)."""
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait(timeout=timeout_s)
    return code, time.monotonic() - t0


# -- hangs (issue 4, 5) -----------------------------------------------------------


def test_stopped_rank_under_decode_load_is_a_hang(supervise):
    run, port = serve(supervise, *HANG_TIMEOUTS, "--inject", f"stop@1:{FAULT_STEP}")
    load = Load(port).start()
    code = run.wait(timeout=EXIT_TIMEOUT_S)
    outcomes = load.stop()
    assert code == 81, run.stderr[-4000:]
    assert load.count("ok") >= 1, f"the engine never served a request before the fault: {outcomes}"
    assert not load.count("timeout"), outcomes
    hang = json.loads((hang_bundle(run) / "summary.json").read_text())
    assert hang["reason"] == "hang"
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    assert "stopped" in hang["verdict"]
    assert hang["watchdog"]["kind"] == "hard" and hang["watchdog"]["hard_source"] == "explicit"
    assert hang["stalled_s"] >= 6.0
    assert any("hang_suspected" in b.name for b in run.bundles())  # the soft watchdog spoke first


def test_skipped_collective_under_decode_load_is_a_hang_named_by_the_flight_recorder(supervise):
    run, port = serve(supervise, *HANG_TIMEOUTS, "--inject", f"hang_collective@1:{FAULT_STEP}")
    load = Load(port).start()
    code = run.wait(timeout=EXIT_TIMEOUT_S)
    outcomes = load.stop()
    assert code == 81, run.stderr[-4000:]
    assert load.count("ok") >= 1, outcomes
    assert not load.count("timeout"), outcomes
    bundle = hang_bundle(run)
    hang = json.loads((bundle / "summary.json").read_text())
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert "_injected_collective_skip" in (bundle / "stacks" / "rank-1.txt").read_text()

    # The analysed flight-recorder section: rank 1 never entered the all_reduce rank 0 is in.
    fr = hang["flight_recorder"]
    assert sorted(fr["collected"]) == [0, 1], fr.get("errors")
    assert fr["culprit_ranks"] == [1]
    first = fr["missing"][0]
    assert first["op"] == "all_reduce" and first["entered"] == [0] and first["missing"] == [1], first
    assert int(first["last_seq"]["1"]) == first["seq"] - 1

    # The raw traces say the same: rank 0's newest default-group entry is an
    # all_reduce that never completed, one past rank 1's newest.
    def default_pg(rank: int) -> list[dict]:
        trace = json.loads((bundle / "fr-json" / f"rank-{rank}.json").read_text())  # fr/ has the pickles
        return [e for e in trace["entries"] if e["process_group"][1] == "default_pg"]

    r0, r1 = default_pg(0), default_pg(1)
    stuck = max(r0, key=lambda e: e["collective_seq_id"])
    assert stuck["profiling_name"].endswith("all_reduce") and not stuck["retired"], stuck
    assert stuck["collective_seq_id"] == first["seq"]
    assert max(e["collective_seq_id"] for e in r1) == stuck["collective_seq_id"] - 1


@pytest.mark.slow  # a "not a hang" run needs tens of seconds of real time: make test-slow
def test_slow_rank_under_load_is_not_a_hang(supervise, tmp_path):
    run, port = serve(supervise, *SLOW_TIMEOUTS, "--inject", "slow@1")
    url = metrics_url(tmp_path)
    load = Load(port).start()
    deadline = time.monotonic() + SLOW_OBSERVE_S
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, f"supervise exited ({run.proc.returncode})\n{run.stderr[-3000:]}"
        time.sleep(0.5)
    body = http_get(url + "/metrics")[1]
    code, _ = terminate(run)
    outcomes = load.stop()
    assert code == 0, run.stderr[-4000:]
    assert run.bundles() == []
    assert load.count("ok") >= 1, f"no request completed on the slow engine: {outcomes}"
    assert not load.count("timeout"), outcomes
    # The injection really slowed the steps (otherwise this proves nothing).
    n = metric_value(body, "supervise_step_duration_seconds_count", {"rank": "1"})
    total = metric_value(body, "supervise_step_duration_seconds_sum", {"rank": "1"})
    assert n and total / n >= 0.75 * SLOW_STEP_S, (n, total)
    assert (metric_value(body, "supervise_hangs_total", {"kind": "soft"}) or 0) == 0


# -- consensus (issue 6) ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["diverge_token", "diverge_batch"])
def test_divergence_under_load_is_caught_before_any_hang(supervise, kind):
    run, port = serve(supervise, *HANG_TIMEOUTS, "--control-plane", "replicated", "--consensus", "enforce",
                      "--inject", f"{kind}@1:{FAULT_STEP}")
    load = Load(port).start()
    code = run.wait(timeout=EXIT_TIMEOUT_S)
    outcomes = load.stop()
    assert code == 82, run.stderr[-4000:]
    assert load.count("ok") >= 1, outcomes
    assert not load.count("timeout"), outcomes
    names = [b.name for b in run.bundles()]
    assert not any("hang" in n for n in names), names  # no hang verdict, not even a soft one
    assert len(fatal_bundles(run)) == 1, names
    summary = run.summary("divergence")
    assert summary["reason"] == "divergence"
    assert summary["culprit_ranks"] == [1], summary["verdict"]
    div = summary["divergence"]
    step = div["step"]
    # STEP counts decode steps; engine steps add the prefill-only ones.
    assert FAULT_STEP <= step <= 3 * FAULT_STEP, step
    assert f"step {step}" in summary["verdict"]
    diff = div["first_difference"]
    values = diff["values"]
    if kind == "diverge_token":
        assert diff["kinds"] == {"0": "tokens", "1": "tokens"}
        assert values["1"] == (values["0"] + 1) % VOCAB, values
        assert f"is {values['1']} where rank 0 has {values['0']}" in summary["verdict"]
    else:
        assert diff["kinds"] == {"0": "batch", "1": "batch"}
        batch0, batch1 = diff["events"]["0"], diff["events"]["1"]
        assert len(batch1) == len(batch0) - 1 and batch1 == batch0[: len(batch1)], diff
        assert values["0"] == batch0[-1] and values["1"] is None


@pytest.mark.slow  # a minute of load on each control plane to show nothing diverges: make test-slow
@pytest.mark.parametrize("plane", ["broadcast", "replicated"])
def test_no_divergence_without_injection(supervise, tmp_path, plane):
    run, port = serve(supervise, "--control-plane", plane, "--consensus", "observe")
    url = metrics_url(tmp_path)
    load = Load(port).start()
    deadline = time.monotonic() + CLEAN_OBSERVE_S
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, f"supervise exited ({run.proc.returncode})\n{run.stderr[-3000:]}"
        time.sleep(0.5)
    served = load.count("ok")
    body = http_get(url + "/metrics")[1]
    code, _ = terminate(run)
    outcomes = load.stop()
    assert code == 0, run.stderr[-4000:]
    assert run.bundles() == []
    assert not load.count("timeout"), outcomes
    assert served >= 10, f"too little load to mean anything: {outcomes}"
    assert all(o[1] == MAX_TOKENS for o in outcomes if o[0] == "ok"), outcomes
    # The checker really compared the steps that served them (at most
    # LOAD_THREADS sequences share a step; half of that, for polling lag).
    compared = metric_value(body, "supervise_consensus_comparisons_total")
    assert compared and compared >= served * MAX_TOKENS / LOAD_THREADS / 2, (compared, served)
    assert metric_value(body, "supervise_consensus_mismatches_total") == 0
    assert metric_value(body, "supervise_divergences_total") == 0


# -- clean shutdown (issue 3) -----------------------------------------------------


def test_sigterm_with_requests_in_flight_answers_them_and_exits_zero(supervise, tmp_path):
    run, port = serve(supervise)
    url = metrics_url(tmp_path)
    long_requests = 256  # seconds of decoding on this machine: certainly in flight at SIGTERM
    load = Load(port, threads=6, max_tokens=long_requests)
    load.start()

    def decoding():
        body = http_get(url + "/metrics")[1]
        return (metric_value(body, "supervise_rank_step", {"rank": "0"}) or 0) >= 40

    wait_for(decoding, 30, what="the engine to decode")
    assert load.count("ok") == 0, "a long request already finished: nothing was in flight"
    code, took = terminate(run)
    outcomes = load.stop()
    assert code == 0, run.stderr[-4000:]
    assert took < 20.0, took
    assert run.bundles() == []
    assert outcomes, "no request was in flight"
    # Nothing hung: no client timed out.  The six requests in flight at SIGTERM
    # (each thread's first) got an error response or a complete one; retries
    # sent after the frontend closed may see a refused connection.
    assert not load.count("timeout"), outcomes
    in_flight = outcomes[: load.threads]
    assert all(o[0] == "http" and o[1] >= 500 or o == ("ok", long_requests) for o in in_flight), in_flight
    assert any(o[0] == "http" for o in in_flight), in_flight


def test_ready_line_carries_a_curl_example_that_works(supervise):
    """Issue 3 acceptance: the ready line's curl example returns a completion."""
    import shlex

    port = free_port()
    run = supervise(["--port", str(port)])  # no command, no --tp: the built-in engine at TP=2
    lines: list[str] = []

    def read_until_ready():
        for line in run.proc.stdout:
            lines.append(line)
            if line.startswith("ready: "):
                return

    reader = threading.Thread(target=read_until_ready, daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    ready = [line for line in lines if line.startswith("ready: ")]
    assert ready, f"no ready line on stdout: {lines[-5:]}"
    argv = shlex.split(ready[0][len("ready: "):])
    assert argv[0] == "curl"
    url = next(a for a in argv if a.startswith("http://"))
    body = argv[argv.index("-d") + 1]
    req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] > 0
    code, _ = terminate(run)
    assert code == 0
    assert len(run.events("rank started")) == 2, "the default is TP=2"
