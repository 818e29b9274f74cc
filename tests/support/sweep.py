"""What supervisors a test SIGKILLed on purpose left behind, swept as the next supervisor on the host would."""

from __future__ import annotations

import os
from pathlib import Path


def sweep_killed(registry: Path, killed: set[int]) -> None:
    """What the supervisors a test SIGKILLed on purpose left (their /dev/shm run directory, registry entry and
    socket): swept as the next supervisor on the host would (processes/stale_runs.py), since a test's private
    registry has no next supervisor.  Only those: a run that ended by itself and left anything is a leak to see."""
    if not killed or not registry.is_dir():
        return
    from tp_supervise.supervisor.observers.control_socket import dead_runs
    from tp_supervise.supervisor.processes.stale_runs import sweep

    saved = os.environ.get("SUPERVISE_REGISTRY_DIR")
    os.environ["SUPERVISE_REGISTRY_DIR"] = str(registry)
    try:
        sweep([run for run in dead_runs() if run.pid in killed])
    finally:
        if saved is None:
            os.environ.pop("SUPERVISE_REGISTRY_DIR", None)
        else:
            os.environ["SUPERVISE_REGISTRY_DIR"] = saved
