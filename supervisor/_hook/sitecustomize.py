"""tp-supervise zero-code hook (put on the ranks' PYTHONPATH by `supervise serve`).

Installs ``supervisor.autohook`` (heartbeats from torch.distributed with no
change to the program), then runs the next ``sitecustomize`` on the path, if
any, so an existing one keeps working.
"""
import os as _os
import sys as _sys


def _tp_supervise_install():
    try:
        import supervisor.autohook as hook
    except ImportError:
        root = _os.environ.get("SUPERVISE_PKG_ROOT")
        if not root:
            return
        _sys.path.append(root)
        try:
            import supervisor.autohook as hook
        except ImportError:
            return
    try:
        hook.install()
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
