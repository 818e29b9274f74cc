"""The CPU of a watched process's helpers (``procinfo.helper_cpu``): its descendants that are not watched, the
live ones and those it has reaped; a watched child and everything below it are not its helpers.  Real processes
burning real CPU."""

from __future__ import annotations

import subprocess
import sys
import time

from tp_supervise.dumps.procinfo import helper_cpu

SPIN = "import time, sys\nwhile time.process_time() < float(sys.argv[1]): pass"
# The root: starts a spinner through a shell (a grandchild, as cc runs cc1), waits for it (reaped), then starts a
# second child that spins for long (the "watched" one in the test) and one more helper, and sleeps.
ROOT = f"""
import subprocess, sys, time
SPIN = {SPIN!r}
subprocess.run(["sh", "-c", f"{{sys.executable}} -c \\"$0\\" 0.5; true", SPIN], check=True)
print("reaped", flush=True)
watched = subprocess.Popen([sys.executable, "-c", SPIN, "30"])
helper = subprocess.Popen([sys.executable, "-c", SPIN, "30"])
print(watched.pid, helper.pid, flush=True)
time.sleep(60)
"""


def test_helpers_are_the_unwatched_descendants_live_and_reaped():
    root = subprocess.Popen([sys.executable, "-c", ROOT], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "reaped"
        watched, helper = map(int, root.stdout.readline().split())
        time.sleep(1.0)
        first = helper_cpu([root.pid], known={watched})[root.pid]
        # the reaped grandchild's half second is in, through the root's cutime
        assert first.cpu_s >= 0.45, first
        assert set(first.live) == {helper}, (first, watched)  # the watched child is not a helper
        assert first.live[helper][0].startswith("python")
        time.sleep(1.0)
        second = helper_cpu([root.pid], known={watched})[root.pid]
        assert second.live[helper][1] > first.live[helper][1], (first, second)  # it works on
        everything = helper_cpu([root.pid], known=set())[root.pid]  # nothing watched: both children are helpers
        assert set(everything.live) == {watched, helper} and everything.cpu_s > second.cpu_s
        assert helper_cpu([root.pid, 2**22 + 1], known=set()).keys() == {root.pid}  # a gone root is absent
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()
