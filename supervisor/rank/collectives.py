"""The torch.distributed collectives the zero-code hook wraps, by name.

Every function through which a rank waits on its peers (or issues work it
waits for later): tensor and object collectives, barriers, point-to-point,
batched point-to-point and the coalesced variants.  Functions missing from
the installed torch are skipped.

Apart from ``autohook`` (which loads the rank runtime: shared memory,
signals, threads), so the supervisor's pure diagnosis
(``tp_supervise.dumps.diagnose``) can recognise these names in a stack
without importing any of that; ``describe`` (a call's shapes, as the slot
shows them) lives here for the same reason.  Standard library only, like
all of ``supervisor/rank/``.
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
    "batch_isend_irecv",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "all_gather_single",
    "reduce_scatter_single",
    "_all_gather_base",
    "_reduce_scatter_base",
)

# The context manager that coalesces the collectives issued in its block; the
# block's exit issues them (and waits for them unless ``async_ops=True``).
COALESCING_MANAGER = "_coalescing_manager"


def _shape_text(value) -> str:
    dims = "x".join(str(d) for d in value.shape) or "scalar"
    return f"{dims} {str(getattr(value, 'dtype', '')).replace('torch.', '')}"


def describe(args: tuple, kwargs: dict) -> str:
    """Shapes and dtype of a collective's first tensor (or tensor list, or list of p2p ops) argument."""
    for value in list(args) + list(kwargs.values()):
        if getattr(value, "shape", None) is not None:
            return _shape_text(value)
        if isinstance(value, (list, tuple)) and value:
            first = value[0]
            if getattr(first, "shape", None) is not None:
                return f"{len(value)}*[{_shape_text(first)}]"
            tensor = getattr(first, "tensor", None)  # torch.distributed.P2POp
            if getattr(tensor, "shape", None) is not None:
                return f"{len(value)} p2p ops [{_shape_text(tensor)}]"
            return f"{len(value)} objects"
    return ""


DESC_CACHE_LIMIT = 1024  # distinct keys in one cache before it starts over


def cached_describe(cache: dict, args: tuple, kwargs: dict) -> str:
    """``describe(args, kwargs)`` through ``cache``, keyed by the first argument's shape and dtype where it has them."""
    first = args[0] if args else None
    head = first[0] if type(first) is list and first else first
    shape = getattr(head, "shape", None)
    if shape is None:
        head = getattr(head, "tensor", None)  # torch.distributed.P2POp
        shape = getattr(head, "shape", None)
    if shape is None:
        return describe(args, kwargs)
    key = (len(first) if type(first) is list else -1, shape, getattr(head, "dtype", None))
    desc = cache.get(key)
    if desc is None:
        if len(cache) >= DESC_CACHE_LIMIT:
            cache.clear()
        desc = cache[key] = describe(args, kwargs)
    return desc
