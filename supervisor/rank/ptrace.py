"""Let the supervisor and its descendants ptrace this process (Yama ``PR_SET_PTRACER``).

py-spy, which reads a rank's stacks, is the supervisor's child: the rank's
sibling, not its ancestor.  Under Yama's ``kernel.yama.ptrace_scope=1`` (the
default of most distributions) a process may only attach to its own
descendants, so py-spy is refused, also for ``process_vm_readv`` (its
``--nonblocking`` mode), unless the rank names a tracer:
``prctl(PR_SET_PTRACER, pid)`` lets ``pid`` *and its descendants* attach
(security/yama/yama_lsm.c: ``ptracer_exception_found`` walks up from the
tracer with ``task_is_descendant``).

* The relation belongs to the tracee's task and is dropped only when the task
  exits (``yama_task_free``); Yama has no exec hook, so it survives
  ``execve``: set between fork and exec, it holds for the program the rank
  runs.  A fork does not inherit it: each process that needs it sets it.
* It only lifts Yama's restriction.  The ordinary checks still apply (same
  uid, the target dumpable), scope 2 needs ``CAP_SYS_PTRACE`` in the tracer,
  scope 3 forbids attaching, and a seccomp profile may forbid ``ptrace`` /
  ``process_vm_readv`` outright.
* Without Yama the call fails with ``EINVAL``: nothing to lift.

Stdlib only, never raises.  ``allow_tracer`` is safe between fork and exec
(``launch`` calls it there): the libc handle is resolved when this module is
imported, so the child loads no library.
"""

from __future__ import annotations

import ctypes

PR_SET_PTRACER = 0x59616D61  # "Yama"
YAMA_SCOPE_FILE = "/proc/sys/kernel/yama/ptrace_scope"

try:
    # The running program's own symbols (libc is among them): no library search, no new load.
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux, or a libc without prctl
    _prctl = None  # type: ignore[assignment]  # absent: allow_tracer says so instead of calling it


def allow_tracer(pid: int) -> bool:
    """Let process ``pid`` and its descendants ptrace this process; True when the kernel took it.

    False, and nothing changed, without Yama, for a pid this process cannot
    see, or on any error.  Replaces a tracer the program named itself (Yama
    keeps one per process).
    """
    if _prctl is None or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        return _prctl(PR_SET_PTRACER, pid, 0, 0, 0) == 0
    except Exception:
        return False


def yama_scope() -> int | None:
    """``kernel.yama.ptrace_scope`` (0-3), or None where Yama is not enabled."""
    try:
        with open(YAMA_SCOPE_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
