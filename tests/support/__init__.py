"""Helpers shared by the tests and the benchmarks: one copy of each, imported from both.

Only the standard library and what the project already depends on; no pytest
import at module level, so the benchmarks (``python -m bench.x`` from the
repository root) can import these modules as ``tests.support.x``.

blockers    what holds the supervisor's I/O: a dump directory whose file opens
            never return (a fanotify gate on a tmpfs), the FIFO fallback, a
            stand-in NVML whose device calls never return
freezer     a cgroup v1 freezer's survivor of SIGKILL: the rank program, freezing
            and thawing it, the run's leftover cgroups
procs       a look at a process in /proc
serving     a supervised engine's HTTP side: waiting until it serves, the official
            client's requests, stopping the supervisor
"""
