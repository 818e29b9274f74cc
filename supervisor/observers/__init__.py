"""Threads that watch and report: they read, judge with the pure policies, and post events.

``watchdog_thread`` (heartbeat slots through ``watchdogs/policy``),
``consensus_thread`` (digest rings, this node's and the other nodes'),
``services`` (what the main loop starts around an attempt), ``http_server``
(/metrics /healthz /readyz /livez), ``metrics`` (the Prometheus registry) and
``control_socket`` (``supervise dump`` and the registry of running jobs).
None of them kills, dumps or changes state.  They may import ``rank/``,
``processes/`` (read-only views), ``nodes/store`` (their own clients), the
vocabulary, and ``watchdogs``/``consensus``/``dumps``; never the decider.
"""
