"""The final state of a run reaches Prometheus with default flags (docs/metrics.md, "Keeping the last scrape"; issue 13).

After a fault, `/metrics` stays up until a scraper took the final state (no
flag needed; at most two scrapes of the documented 5 s config; not at all
when nothing scraped: tests/e2e/test_serving_through_faults.py), and
`--metrics-textfile` leaves the final counts in a file node_exporter's
textfile collector serves after the process is gone.  A clean run does not
linger; an explicit `--metrics-linger` lingers that long, and a second
Ctrl-C ends it.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime

from tests.conftest import fake_rank
from tests.live import http_get, metric_value
from tp_supervise.supervisor.rank.net import free_port
from tp_supervise.supervisor.spec import DEFAULT_FAULT_LINGER_S

SCRAPE_S = 1.0  # the test's scraper


def test_after_a_fault_the_default_linger_ends_at_the_first_scrape_of_the_final_state(supervise, tmp_path):
    port = free_port()
    textfile = tmp_path / "tp_supervise.prom"
    run = supervise(["--nproc-per-node", "2", "--metrics-textfile", str(textfile)],
                    fake_rank("--all", "sleep", "--on", "1=exit:3", "--delay", "1"),
                    metrics_addr=f"127.0.0.1:{port}", default_linger=True)
    url = f"http://127.0.0.1:{port}/metrics"
    seen: list[tuple[float, float | None]] = []  # (wall clock, the exit counter) of every scrape that answered
    done = threading.Event()

    def scrape() -> None:  # a scraper every SCRAPE_S, as Prometheus would be
        while not done.wait(SCRAPE_S):
            try:
                _, body = http_get(url, timeout=2)
            except OSError:
                continue
            seen.append((time.time(), metric_value(body, "supervise_rank_exits_total", {"reason": "nonzero"})))

    scraper = threading.Thread(target=scrape, name="test-scraper", daemon=True)
    scraper.start()
    try:
        assert run.wait(timeout=60) == 80
    finally:
        done.set()
        scraper.join(5)
    ended = time.time()
    linger = run.events("metrics stay up before exit")[0]
    assert linger["seconds"] == DEFAULT_FAULT_LINGER_S and "scrape" in linger["until"]
    assert run.events("final metrics scraped")
    exiting = datetime.fromisoformat(run.events("supervise exiting")[0]["timestamp"].replace("Z", "+00:00")).timestamp()
    final = [value for at, value in seen if at >= exiting]
    assert final and final[-1] == 1, "a scrape after the end saw the final count"
    # it did not wait out the ceiling: the first scrape of the final state ended it
    assert ended - exiting < SCRAPE_S + 3 < DEFAULT_FAULT_LINGER_S, ended - exiting
    text = textfile.read_text()
    assert 'supervise_rank_exits_total{' in text and 'reason="nonzero"' in text


def test_a_clean_run_does_not_linger_and_a_second_ctrl_c_ends_a_linger(supervise, tmp_path):
    clean = supervise(["--nproc-per-node", "1"], fake_rank("--all", "finish", "--steps", "3"), default_linger=True)
    assert clean.wait(timeout=30) == 0
    assert not clean.events("metrics stay up before exit")
    run = supervise(["--nproc-per-node", "1", "--metrics-linger", "60"], fake_rank("--all", "exit:3", "--delay", "0.5"))
    time.sleep(5)  # the rank exited at 0.5 s; the supervisor is lingering now
    assert run.proc.poll() is None
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert run.wait(timeout=30) == 80
    assert time.monotonic() - t0 < 10, "a second Ctrl-C must end the linger"
