"""The observers' room never kills (docs/architecture.md), read from the source with ``ast`` (issue 37)."""

from __future__ import annotations

import ast

from tests.test_layers import ROOT, _imports
KILLING_CALLS = {"kill", "killpg", "terminate", "send_signal", "pidfd_send_signal", "rmtree"}
KILLING_MODULES = {"supervisor.processes.teardown.teardown", "supervisor.processes.stale_runs.sweep"}


def test_observers_observe():
    """The observers' room never kills a process nor removes what a run owns (docs/architecture.md): they read and
    post; the decider acts (the teardown, the sweep of dead runs)."""
    found = []
    for path in (ROOT / "supervisor" / "observers").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KILLING_CALLS:
                found.append(f"{path.name}:{node.lineno} .{node.func.attr}()")
        found += [f"{path.name} imports {m}" for m in _imports(path) & KILLING_MODULES]
    assert found == []
