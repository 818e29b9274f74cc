"""The mechanism of processes: spawn, hold, watch, end.

``spawn`` (the torchrun-compatible environment, sessions, death pipe,
parent-death signal, cgroup join), ``pidfds`` (every process held by a
pidfd, run-marker scans, orphan reaping), ``cgroup`` (one per run),
``exit_monitor`` (the thread that sees every death), ``exits`` (what a wait
status says), ``teardown`` (SIGTERM, one grace, SIGKILL, verified), ``shm``
(the /dev/shm files the run's processes map or registered, removed once they
are gone), ``stale_runs`` (what a supervisor that died without a teardown
left, ended by the next one), ``output_pump`` and ``rank_logs`` (the ranks'
stdout/stderr, to the console and to ``--log-dir``), ``attempt`` (the live
state of one launch, published read-only to the other threads; what an
observer keeps of one attempt) and ``listen_socket`` (the serving ports,
bound once for the run: rank 0's, inherited by rank 0 of every attempt, and
the relay's public one; the relay itself has its own room,
``supervisor/relay/``).  It decides nothing: it may import ``rank/``, the
vocabulary (``events``, ``outcome``, ``spec``, ``signals``, ``logs``) and
``tp_supervise.dumps`` helpers, never the decider or another room.
"""
