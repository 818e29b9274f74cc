"""`make bench`: every benchmark, one after the other (each prints its figures).

Results go into docs/benchmarks.md by hand or with each benchmark's own
--update-docs/--write-docs flag; this runner only runs them.
"""

from __future__ import annotations

import subprocess
import sys

BENCHES = [
    ["bench.bench_core"],
    ["bench.bench_heartbeat"],
    ["bench.bench_dumps"],
    ["bench.bench_consensus"],
    ["bench.bench_detection"],
    ["bench.bench_early_detection"],
    ["bench.bench_hook_startup"],
    ["bench.bench_engine"],
    ["bench.bench_alert_delivery", "--runs", "10"],
    ["bench.bench_multinode", "--nodes", "24"],  # 64 (the goal) needs more than 2 cores: docs/benchmarks.md
]


def main() -> int:
    failed = []
    for bench in BENCHES:
        print(f"=== {bench[0]}", flush=True)
        if subprocess.run([sys.executable, "-m", *bench]).returncode != 0:
            failed.append(bench[0])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
