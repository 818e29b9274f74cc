"""What tp-supervise puts into the user's rank processes (issue 10).

A zero-code rank loads the rank-side package only (stdlib + itself), never
the supervisor's libraries or parent-side packages; the built-in engine's
ranks load only what the engine itself needs.  The hook loads the rank-side
package from the supervisor's own tree by file location, so it also works in
an interpreter that does not have tp-supervise installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

MODULES_RANK = ROOT / "tests" / "fakes" / "modules_rank.py"
SUPERVISOR_LIBS = ("structlog", "rich", "prometheus_client", "psutil", "pynvml", "aiohttp", "zmq")
PARENT_SIDE = ("tp_supervise.dumps", "tp_supervise.watchdogs", "tp_supervise.consensus", "tp_supervise.engine")
RANK_PACKAGE = "tp_supervise.supervisor.rank"
RUN_TIMEOUT_S = 120


def loaded(supervise, tmp_path: Path, command: list[str], nproc: int = 2, hook: bool = True) -> list[dict]:
    out = tmp_path / ("hooked" if hook else "plain")
    out.mkdir()
    args = ["--nproc-per-node", str(nproc)] + ([] if hook else ["--no-hook"])
    run = supervise(args, [*command[:1], str(MODULES_RANK), str(out), *command[1:]])
    code = run.wait(RUN_TIMEOUT_S)
    assert code == 0, run.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def top(name: str) -> str:
    return name.split(".")[0]


def test_zero_code_rank_loads_no_supervisor_library(supervise, tmp_path):
    hooked = loaded(supervise, tmp_path, [sys.executable, "--torch"])
    plain = loaded(supervise, tmp_path, [sys.executable, "--torch"], hook=False)
    torch_own = {top(m) for r in plain for m in r["modules"]}  # torch.cuda imports pynvml itself when present
    for rank in hooked:
        mods = set(rank["modules"])
        assert f"{RANK_PACKAGE}.autohook" in mods, "the hook did not load"
        leaked = sorted(m for m in mods if top(m) in SUPERVISOR_LIBS and top(m) not in torch_own)
        assert not leaked, f"supervisor libraries in a zero-code rank: {leaked}"
        # the bare namespace package (no code) may be imported by an editable install's path finder
        ours = sorted(m for m in rank["ours"] if not m.startswith(RANK_PACKAGE) and m != "tp_supervise")
        assert not ours, f"parent-side modules in a zero-code rank: {ours}"
        assert not any(m.startswith(PARENT_SIDE) for m in mods)


def test_builtin_engine_rank_loads_only_what_the_engine_needs(tmp_path):
    """Rank 0 of the engine under supervision: aiohttp (its HTTP frontend) and pyzmq are the engine's own."""
    from tp_supervise.supervisor.rank.net import free_port

    script = ("import json, sys, runpy; sys.argv = ['tp_supervise.engine'] + sys.argv[1:];\n"
              "import atexit; atexit.register(lambda: open(%r, 'w').write(json.dumps(sorted(sys.modules))));\n"
              "runpy.run_module('tp_supervise.engine', run_name='__main__')")
    # the engine exits on SIGTERM; the atexit hook records its modules then
    out = tmp_path / "modules.json"
    env = {**os.environ, "SUPERVISE_REGISTRY_DIR": str(tmp_path / "registry")}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--tp", "1", "--port",
                             str(port), "--metrics-addr", "none", "--dump-dir", str(tmp_path / "d"), "--",
                             sys.executable, "-c", script % str(out), "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from tests.live import http_get, wait_for

        wait_for(lambda: _ok(http_get, f"http://127.0.0.1:{port}/health") or proc.poll() is not None, 90,
                 "engine health")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-3000:]
    mods = set(json.loads(out.read_text()))
    assert "aiohttp" in mods and "zmq" in mods  # the engine's own
    leaked = sorted(m for m in mods if top(m) in ("structlog", "rich", "prometheus_client", "psutil"))
    assert not leaked, f"supervisor libraries in an engine rank: {leaked}"
    parent = sorted(m for m in mods if m.startswith(PARENT_SIDE[:3]) or
                    (m.startswith("tp_supervise.supervisor.") and not m.startswith(RANK_PACKAGE)))
    assert not parent, f"parent-side modules in an engine rank: {parent}"


def _ok(http_get, url: str) -> bool:
    try:
        return http_get(url)[0] == 200
    except OSError:
        return False


def base_interpreter() -> str | None:
    """An interpreter without tp-supervise installed (the one the venv was made from)."""
    if sys.prefix == sys.base_prefix:
        return None  # not in a venv: this interpreter is the one tp-supervise is installed in
    candidate = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    if not os.path.exists(candidate):
        return None
    probe = subprocess.run([candidate, "-c", "import tp_supervise.supervisor"], capture_output=True)
    return candidate if probe.returncode != 0 else None


def test_hook_works_in_an_interpreter_without_tp_supervise(supervise, tmp_path):
    python = base_interpreter()
    if python is None:
        pytest.skip("no interpreter without tp-supervise installed on this host")
    ranks = loaded(supervise, tmp_path, [python], nproc=1)
    ours = ranks[0]["ours"]
    assert f"{RANK_PACKAGE}.autohook" in ours
    package_dir = str((ROOT / "supervisor" / "rank").resolve())
    assert all(path is None or path.startswith(package_dir) for path in ours.values()), ours
