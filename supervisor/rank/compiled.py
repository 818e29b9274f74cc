"""Is the compiler tracing this call?  The gate every wrapper of the hook passes first.

Engines compile their model by default (vLLM and SGLang: ``torch.compile``
with ``fullgraph=True``; on GPUs they also capture CUDA graphs), and a
collective of the model's forward is then traced, not run: Dynamo inlines
every Python function on its way, our wrappers included.  A wrapper that
touches a ``threading.local``, a lock, an ``Event`` or shared memory there is
a graph break, and with ``fullgraph`` a break is fatal (the engine's warm-up
raises ``torch._dynamo.exc.Unsupported``).  So each wrapper starts with::

    if compiled.is_compiling():
        return fn(*args, **kwargs)

``is_compiling`` is ``torch.compiler.is_dynamo_compiling``: while Dynamo
traces, its trace rules fold the call to a constant True, so the traced graph
holds the engine's call and nothing of ours (the same graph as without the
hook, and no side effect); in eager code it is a function that returns False
(~50 ns, a third of ``torch.compiler.is_compiling``, which also asks
TorchScript; the hook's wrappers are never scripted).  Once compiled, the graph runs
without any Python of ours: in compiled and CUDA-graph modes the collectives
inside the model are not seen one by one, and progress comes from the seams
outside it (docs/watchdogs.md, "Engine modes").

``is_compiling`` answers False until ``torch.compiler`` is loaded (nothing can
compile before it is); the hook's finder calls ``bind`` with the module right
after it loads.  Stdlib only, like all of ``supervisor/rank/``.
"""

from __future__ import annotations

from typing import Any


def _never() -> bool:
    return False


is_compiling = _never


def bind(module: Any) -> None:
    """Take ``torch.compiler.is_dynamo_compiling`` (``is_compiling``, or ``torch._dynamo.is_compiling``, on a torch
    that predates it)."""
    global is_compiling
    fn = getattr(module, "is_dynamo_compiling", None) or getattr(module, "is_compiling", None)
    if fn is None:
        import sys

        fn = getattr(sys.modules.get("torch._dynamo"), "is_compiling", None)
    if callable(fn):
        is_compiling = fn
