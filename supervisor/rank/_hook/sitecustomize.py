"""tp-supervise zero-code hook (its folder is put on the ranks' PYTHONPATH by `supervise serve`).

Loads the rank-side package (``tp_supervise.supervisor.rank``, the folder
above this one) by file location, so it is the supervisor's own copy that
runs, even in an interpreter that does not have tp-supervise installed or has
another version of it; installs its ``autohook`` (heartbeats from
torch.distributed with no change to the program); then runs the next
``sitecustomize`` on the path, if any, so an existing one keeps working.
Nothing here may break the user's program.
"""
import os as _os
import sys as _sys

_RANK_PACKAGE = "tp_supervise.supervisor.rank"


def _tp_supervise_load_rank_package():
    import importlib.util

    if _RANK_PACKAGE in _sys.modules:
        return _sys.modules[_RANK_PACKAGE]
    top = _RANK_PACKAGE.split(".")[0]
    if top not in _sys.modules and importlib.util.find_spec(top) is None:
        # Not installed in this interpreter.  The import system imports the top-level
        # package of every dotted import (``__import__("a.b.c")`` returns ``a``), so give
        # it an empty namespace; our modules themselves come from the files below.
        import types

        stub = types.ModuleType(top)
        stub.__path__ = []
        _sys.modules[top] = stub
    here = _os.path.dirname(_os.path.abspath(__file__))
    package_dir = _os.path.dirname(here)
    spec = importlib.util.spec_from_file_location(
        _RANK_PACKAGE, _os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir])
    module = importlib.util.module_from_spec(spec)
    _sys.modules[_RANK_PACKAGE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del _sys.modules[_RANK_PACKAGE]
        raise
    return module


def _tp_supervise_install():
    try:
        _tp_supervise_load_rank_package()
        from tp_supervise.supervisor.rank import autohook

        autohook.install()
    except Exception as exc:  # never break the user's program
        print(f"supervise: zero-code hook not installed: {exc!r}", file=_sys.stderr)


def _tp_supervise_chain():
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    for entry in list(_sys.path):
        if _os.path.abspath(entry or ".") == here:
            continue
        candidate = _os.path.join(entry or ".", "sitecustomize.py")
        if _os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if _os.environ.get("SUPERVISE_HEARTBEAT"):
    _tp_supervise_install()
_tp_supervise_chain()
