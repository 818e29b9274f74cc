"""The torch.distributed collectives the zero-code hook wraps, by name.

A constant apart from ``autohook`` (which loads the rank runtime: shared
memory, signals, threads), so the supervisor's pure diagnosis
(``tp_supervise.dumps.diagnose``) can recognise these names in a stack
without importing any of that.  Standard library only, like all of
``supervisor/rank/``.
"""

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "monitored_barrier",
)
