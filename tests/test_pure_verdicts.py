"""Verdict modules are pure: importing one loads no I/O library (docs/contracts.md, "Package boundaries").

Each module is imported in a fresh interpreter, since this test process has
long since loaded everything; the check is what that import actually pulls
in, transitively (``platform`` or ``uuid`` import ``subprocess``, for one).
Modules the interpreter already holds before the import (``site`` and the
editable install's finder load ``urllib.parse`` and ``pathlib``) are not the
module's doing and are left out.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

VERDICT_MODULES = (
    "tp_supervise.watchdogs.policy",
    "tp_supervise.watchdogs.adaptive",
    "tp_supervise.watchdogs.straggler",
    "tp_supervise.watchdogs.straggler_nodes",
    "tp_supervise.consensus.compare",
    "tp_supervise.consensus.verdict",
    "tp_supervise.dumps.diagnose",
    "tp_supervise.dumps.fr_analysis",
)

# Third-party and stdlib I/O: processes, sockets, HTTP, NVML, logging/rendering stacks.
FORBIDDEN_LIBRARIES = (
    "subprocess",
    "socket",
    "urllib",
    "http",
    "ssl",
    "select",
    "selectors",
    "signal",
    "asyncio",
    "multiprocessing",
    "psutil",
    "pynvml",
    "structlog",
    "rich",
    "prometheus_client",
    "zmq",
    "aiohttp",
    "torch",
)

# Our own edge modules: they spawn, signal, read /proc, scrape, talk NVML or map shared memory rings.
FORBIDDEN_OWN = (
    "tp_supervise.dumps.capture",
    "tp_supervise.dumps.procinfo",
    "tp_supervise.dumps.slowness",
    "tp_supervise.dumps.flight_capture",
    "tp_supervise.dumps.bundle",
    "tp_supervise.dumps.incident",
    "tp_supervise.dumps.render",
    "tp_supervise.watchdogs.adapters",
    "tp_supervise.watchdogs.gpu",
    "tp_supervise.consensus.monitor",
    "tp_supervise.supervisor.rank.runtime",
    "tp_supervise.supervisor.rank.autohook",
)

PROBE = (
    "import sys; before = sorted(sys.modules); import importlib; importlib.import_module(sys.argv[1]); "
    "after = sorted(sys.modules); import json; print(json.dumps([before, after]))"
)


def loaded_by(module: str) -> list[str]:
    """The modules that importing ``module`` adds to a fresh interpreter's ``sys.modules``."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    before, after = json.loads(proc.stdout)
    return sorted(set(after) - set(before))


def _hits(loaded: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == n or m.startswith(n + ".") for n in names))


@pytest.mark.parametrize("module", VERDICT_MODULES)
def test_verdict_module_imports_no_io(module: str) -> None:
    loaded = loaded_by(module)
    assert module in loaded
    assert _hits(loaded, FORBIDDEN_LIBRARIES) == []
    assert _hits(loaded, FORBIDDEN_OWN) == []
