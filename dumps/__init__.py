"""Stack capture, flight recorder, diagnosis, incident bundles and their rendering.

Entry points for the supervisor: ``dumps.incident.write_incident`` (one call
per incident), ``dumps.bundle.BundleWriter``, ``dumps.capture.RankTarget``,
``tp_supervise.supervisor.rank.flight.rank_env`` (per-rank environment) and ``dumps.analyze.main``
(``supervise analyze``).  This package never decides *when* to dump.
"""
