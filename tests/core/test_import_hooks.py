"""The zero-code hook's import finder beside a program's own import hook.

A program (or a test plugin, or a tracing library) may install a meta-path
finder that, like ours, asks every other finder for the spec and wraps the
loader.  Each then asks the other back for the same name; without a guard the
two recurse until RecursionError and the program dies at its first
``import torch.distributed``.  Both must run: the program's hook sees the
module, and ours still patches it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tp_supervise.supervisor.processes.spawn import HOOK_DIR
from tp_supervise.supervisor.rank import runtime

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import importlib.abc, json, sys

    ran = []

    class Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner
        def create_module(self, spec):
            return self.inner.create_module(spec)
        def exec_module(self, module):
            self.inner.exec_module(module)
            ran.append(module.__name__)

    class Delegating(importlib.abc.MetaPathFinder):
        # asks every finder but itself, as many import hooks do
        def find_spec(self, fullname, path, target=None):
            if fullname != "torch.distributed":
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = Loader(spec.loader)
                    return spec
            return None

    sys.meta_path.insert(int(sys.argv[1]), Delegating())
    import torch.distributed as dist
    print(json.dumps({
        "program_hook_ran": ran,
        "ours_first": "autohook" in type(sys.meta_path[0]).__module__,
        "patched": bool(getattr(dist.all_reduce, "__tp_supervise_wrapped__", False)),
    }))
    """
)


def run_program(tmp_path: Path, position: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), str(ROOT)])
    env[runtime.ENV_HEARTBEAT] = str(tmp_path / "no-segment")  # "under supervise serve"; no slot is claimed
    for name in (runtime.ENV_SLOT, "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(position)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_delegating_finder_after_ours_does_not_recurse(tmp_path):
    out = run_program(tmp_path, 1)
    assert out["ours_first"]
    assert out["program_hook_ran"] == ["torch.distributed"]
    assert out["patched"], "the hook did not patch torch.distributed"


def test_a_delegating_finder_before_ours_does_not_recurse(tmp_path):
    out = run_program(tmp_path, 0)
    assert out["program_hook_ran"] == ["torch.distributed"]
    assert out["patched"], "the hook did not patch torch.distributed"
