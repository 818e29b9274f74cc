"""Everything that runs inside a rank process (the supervisor's guest code).

The runtime API the engine calls (``runtime``), the zero-code hook and its
``sitecustomize`` (``autohook``, ``_hook/``) with the names of the collectives
it wraps (``collectives``, which the pure diagnosis reads too), the
shared-memory layouts and their writers and readers (``heartbeat``, ``ring``:
the one definition of each wire format, which the supervisor side imports),
consensus recording (``consensus``, ``encoding``, ``channel``, ``inband``) and
the flight-recorder server start-up (``flight``).

The rule of this package: the standard library, plus torch imported lazily
and only when the program already uses it.  It never imports parent-side
code (``tp_supervise.supervisor`` outside ``rank``, ``dumps``, ``watchdogs``,
``consensus``), and inside it every import is relative, so the hook can load
it by file location into an interpreter that does not have tp-supervise
installed.
"""
