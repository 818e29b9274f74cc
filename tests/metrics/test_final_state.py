"""The final state of a run reaches Prometheus with default flags (docs/metrics.md, "Keeping the last scrape"; issue 13).

After a fault, `/metrics` stays up long enough for two scrapes of the
documented 5 s config (no flag needed), and `--metrics-textfile` leaves the
final counts in a file node_exporter's textfile collector serves after the
process is gone.  A clean run does not linger.
"""

from __future__ import annotations

import signal
import time

from tp_supervise.supervisor.rank.net import free_port
from tp_supervise.supervisor.spec import DEFAULT_FAULT_LINGER_S
from tests.conftest import fake_rank
from tests.live import http_get, metric_value, wait_for

SCRAPE_INTERVAL_S = 5.0  # docs/prometheus/prometheus.yml


def test_after_a_fault_metrics_linger_by_default_and_the_textfile_keeps_the_counts(supervise, tmp_path):
    port = free_port()
    textfile = tmp_path / "tp_supervise.prom"
    run = supervise(["--nproc-per-node", "2", "--metrics-textfile", str(textfile)],
                    fake_rank("--all", "sleep", "--on", "1=exit:3", "--delay", "1"),
                    metrics_addr=f"127.0.0.1:{port}", default_linger=True)
    url = f"http://127.0.0.1:{port}/metrics"

    def exits_seen():
        try:
            status, body = http_get(url, timeout=2)
        except OSError:
            return None
        value = metric_value(body, "supervise_rank_exits_total", {"reason": "nonzero"})
        return value if value and value >= 1 else None

    wait_for(exits_seen, 30, "the rank exit on /metrics")
    exiting = time.monotonic()
    # still scrapeable for two scrape intervals after the fault
    time.sleep(2 * SCRAPE_INTERVAL_S - 1)
    assert exits_seen(), "/metrics went away before two scrapes could see the final state"
    assert run.wait(timeout=60) == 80
    assert time.monotonic() - exiting >= 2 * SCRAPE_INTERVAL_S - 1
    assert run.events("metrics stay up before exit")[0]["seconds"] == DEFAULT_FAULT_LINGER_S
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
