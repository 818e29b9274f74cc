"""A light rank for the multi-node benchmark: the rank-side runtime and nothing else (no torch).

    python -S bench/light_rank.py [--package DIR] [--steps-per-s HZ]

Run with ``-S`` (no site: no site-packages scan, no editable-install finder):
the rank package (``supervisor/rank``, stdlib only) is loaded by file
location, the way the zero-code hook loads it (supervisor/rank/_hook/
sitecustomize.py), from ``--package`` (default: this tree's), so the same
stand-in runs under another checkout of the supervisor.  About 13 MiB of RSS
per process, most of it the interpreter's shared pages: 512 of them fit
where 512 torch ranks would not.

The rank says ``starting`` and ``ready`` through the runtime (heartbeat slot,
death watch: it exits when its supervisor dies, as a real rank does), then
idles (``--steps-per-s 0``, the default: the supervisors and their store are
what is measured) or runs instrumented steps with one fake collective each
at that rate (the watchdogs see progress).  The benchmark makes the fault
from outside (a SIGKILL of one of these processes), so there is no fault
injection here.
"""

import argparse
import importlib.util
import os
import sys
import time
import types

PACKAGE = "tp_supervise.supervisor.rank"
DEFAULT_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "supervisor", "rank")


def load_runtime(package_dir: str):
    """``tp_supervise.supervisor.rank.runtime`` from ``package_dir`` (its imports inside are relative)."""
    for name in ("tp_supervise", "tp_supervise.supervisor"):  # empty parents: nothing else gets imported
        parent = types.ModuleType(name)
        parent.__path__ = []
        sys.modules[name] = parent
    spec = importlib.util.spec_from_file_location(PACKAGE, os.path.join(package_dir, "__init__.py"),
                                                  submodule_search_locations=[package_dir])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return importlib.import_module(PACKAGE + ".runtime")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--package", default=DEFAULT_PACKAGE_DIR, help="the supervisor/rank folder to load")
    p.add_argument("--steps-per-s", type=float, default=0.0, help="0: idle after ready")
    args = p.parse_args()
    sv = load_runtime(args.package)
    sv.starting()
    sv.ready()
    if args.steps_per_s <= 0:
        while True:
            time.sleep(3600)
    period = 1.0 / args.steps_per_s
    while True:
        with sv.step():
            with sv.collective("all_reduce", "64x256 float32"):
                time.sleep(0.001)
        time.sleep(period)


if __name__ == "__main__":
    main()
