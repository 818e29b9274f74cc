"""``python -m tp_supervise.supervisor.cli``: the ``supervise`` command."""

import sys

from . import main

sys.exit(main())
