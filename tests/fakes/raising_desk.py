"""`supervise`, with an incident desk whose hard-hang handler raises (a bug of ours, on purpose).

    python raising_desk.py serve [OPTIONS] [-- COMMAND ...]     (the arguments of `supervise`)

The desk raises after the supervisor has ruled the hang (state HUNG, the watchdog
will not fire again): the run must still end, with the internal-error exit (70)
and a teardown that leaves no process.  Nothing else differs from `supervise`.
"""

import sys

from tp_supervise.supervisor.cli import main
from tp_supervise.supervisor.incidents import desk


def raising_hard_hang(self, *args, **kwargs):
    raise RuntimeError("the desk broke on purpose (tests/fakes/raising_desk.py)")


desk.IncidentDesk.hard_hang = raising_hard_hang

if __name__ == "__main__":
    sys.exit(main())
