"""``python -m tp_supervise.supervisor.relay``: the relay process (supervisor/relay/main.py)."""

import sys

from .main import main

sys.exit(main())
