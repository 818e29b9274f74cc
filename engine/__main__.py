"""``python -m tp_supervise.engine [ENGINE ARGS]``: one rank of the reference tensor-parallel engine.

Runs under ``supervise serve`` (which sets the torchrun environment and the
SUPERVISE_* variables) or standalone; see docs/engine.md.

An exception out of the engine prints its traceback and exits 1 at once,
without interpreter finalization: with peers gone or blocked, tearing down
torch.distributed objects at exit can hang or abort (SIGABRT), which would
disguise a Python crash as a native one.
"""

from __future__ import annotations

import os
import sys

CRASH_EXIT_CODE = 1


def main(argv: list[str] | None = None) -> int:
    # Report "starting" before anything slow (argument checks are fast; torch is not).
    from . import instrument

    instrument.starting()
    from .args import parse_args

    cfg, dist_env, model_cfg = parse_args(argv)
    from .app import run

    try:
        return run(cfg, dist_env, model_cfg)
    except Exception:
        sys.excepthook(*sys.exc_info())  # the traceback; hooks (e.g. the supervisor's) note the crash
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(main())
