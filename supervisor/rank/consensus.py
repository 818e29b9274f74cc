"""Rank side of the consensus check (torch-free; imported by ranks).

The engine calls two functions, on every rank, from the thread that runs
steps::

    from tp_supervise.supervisor.rank import consensus
    consensus.record("sample", {"seq": ids, "tokens": tokens})   # any number per step
    consensus.end_step(step_index)                                # once per engine step

Events recorded since the previous ``end_step`` belong to step
``step_index``.  ``record`` encodes the event canonically
(supervisor/rank/encoding.py), folds it into the step's running digest and stores it
in this rank's digest ring (supervisor/rank/ring.py) at once, so the supervisor can
read the events of a step that never ends (a hang or an abort one collective
later).  ``end_step`` publishes step, digest and event count.  Both are a few
memory copies into a shared mapping: no system call, no lock, no collective,
so they never block the rank.  The ring keeps the last ``depth`` steps' events,
which is what the supervisor diffs when digests differ.

Both functions are no-ops (one global load and a compare) when the process is
not supervised or ``SUPERVISE_CONSENSUS`` is off.  With
``SUPERVISE_CONSENSUS_INBAND=N`` the rank also compares its digest with its
peers every N steps through a gloo group (supervisor/rank/inband.py): that mode adds
collectives and exists only so the benchmark can compare both designs.

``@rank_consensus`` records a function's result and chosen arguments::

    @rank_consensus(args=("prefix_len",))
    def match_prefix(self, prefix_len, tokens): ...
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import compiled, encoding
from .channel import RankConsensusSpec
from .ring import RingWriter

if TYPE_CHECKING:
    from .inband import InbandChecker

# A step's stored log may use at most this share of the ring's log area, so
# one huge step cannot evict every earlier step's log (the digest still
# covers every event; the entry is flagged truncated).
STEP_LOG_SHARE = 4


def _warn(event: str, **fields: Any) -> None:
    """One line on stderr (a guest in the rank: no logging library of ours)."""
    detail = " ".join(f"{k}={v!r}" for k, v in fields.items())
    print(f"supervise: consensus: {event} {detail}".rstrip(), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PublishedStep:
    step: int
    digest: bytes
    count: int
    truncated: bool


class Recorder:
    """Per-process recording state.  Not thread safe: call from the step thread."""

    def __init__(self, spec: RankConsensusSpec, writer: RingWriter | None):
        self.spec = spec
        self._writer = writer
        self._limit = spec.log_bytes // STEP_LOG_SHARE
        self._hasher = encoding.new_hasher()
        self._count = 0
        self._stored = 0
        self._truncated = False
        self.steps = 0
        self.last: PublishedStep | None = None
        self._inband: InbandChecker | None = None
        self._inband_failed = False
        self.inband_checks = 0
        self.inband_mismatches = 0

    def record(self, kind: str, payload: Any) -> None:
        data = encoding.event_bytes(kind, payload)
        self._hasher.update(data)
        self._count += 1
        writer = self._writer
        if writer is None:
            return
        try:
            if not self._truncated and self._stored + len(data) <= self._limit:
                writer.append(data)
                self._stored += len(data)
            else:
                self._truncated = True  # keep the stored log a prefix of the step's events
                writer.count_only()
        except (ValueError, OSError) as exc:
            self._drop_writer(exc)

    def begin_step(self, step_index: int) -> None:
        if self._writer is not None:
            try:
                self._writer.announce(step_index)
            except (ValueError, OSError) as exc:
                self._drop_writer(exc)

    def end_step(self, step_index: int) -> PublishedStep:
        dig = self._hasher.digest()
        published = PublishedStep(step_index, dig, self._count, self._truncated)
        self._hasher = encoding.new_hasher()
        self._count = 0
        self._stored = 0
        self._truncated = False
        self.steps += 1
        self.last = published
        if self._writer is not None:
            try:
                self._writer.publish(step_index, dig, published.truncated, time.monotonic())
            except (ValueError, OSError) as exc:
                self._drop_writer(exc)
        if self.spec.inband_every:
            self._check_inband(step_index, dig)
        return published

    def _drop_writer(self, exc: Exception) -> None:
        """Publishing failed (ring unmapped?): stop publishing rather than break the engine."""
        _warn("consensus_publish_failed", error=repr(exc), ring=str(self._writer.path if self._writer else ""))
        self._writer = None

    # -- in-band comparison (benchmark mode) ---------------------------------
    def attach_inband(self, group: Any) -> None:
        from .inband import InbandChecker

        self._inband = InbandChecker(group, self.spec.inband_every)

    def _check_inband(self, step_index: int, dig: bytes) -> None:
        if self._inband is None:
            if self._inband_failed:
                return
            dist = sys.modules.get("torch.distributed")
            if dist is None or not dist.is_initialized():
                return
            try:
                from .inband import InbandChecker, world_cpu_group

                self._inband = InbandChecker(world_cpu_group(), self.spec.inband_every)
            except Exception as exc:  # never break the engine for a benchmark mode
                self._inband_failed = True
                _warn("consensus_inband_unavailable", error=repr(exc))
                return
        if step_index % self.spec.inband_every:
            return
        self.inband_checks += 1
        if not self._inband.check(step_index, dig):
            self.inband_mismatches += 1
            _warn("consensus_inband_mismatch", step=step_index, digest=dig.hex())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


_recorder: Recorder | None = None


def configure(environ: Mapping[str, str] | None = None) -> Recorder | None:
    """(Re)read the consensus environment; returns the recorder, or None when off.

    Runs at import with ``os.environ``.  Bad settings disable recording with a
    warning instead of failing the rank.
    """
    global _recorder
    env = os.environ if environ is None else environ
    if _recorder is not None:
        _recorder.close()
        _recorder = None
    try:
        spec = RankConsensusSpec.from_env(env)
    except ValueError as exc:
        _warn("consensus_disabled", reason=str(exc))
        return None
    if not spec.records:
        return None
    writer = None
    if spec.publishes and spec.ring is not None:
        try:
            rank = int(env.get("RANK", "") or spec.slot)
            writer = RingWriter(spec.ring, slot=spec.slot, rank=rank, depth=spec.depth, log_bytes=spec.log_bytes)
        except (OSError, ValueError) as exc:
            _warn("consensus_ring_unavailable", ring=str(spec.ring), error=repr(exc))
            if not spec.inband_every:
                return None
    _recorder = Recorder(spec, writer)
    return _recorder


def _forget_in_child() -> None:
    """A forked child is not the rank: it must not write the parent's ring."""
    global _recorder
    _recorder = None


os.register_at_fork(after_in_child=_forget_in_child)


def enabled() -> bool:
    return _recorder is not None


def recorder() -> Recorder | None:
    return _recorder


def record(kind: str, payload: Any = None) -> None:
    """Record one consensus event of the current step (no-op when off)."""
    rec = _recorder
    if rec is not None:
        rec.record(kind, payload)


def end_step(step_index: int) -> None:
    """Close step ``step_index`` (same index on every rank) and publish its digest."""
    rec = _recorder
    if rec is not None:
        rec.end_step(step_index)


def begin_step(step_index: int) -> None:
    """Optional: announce the index of the step now starting.

    Without it, a divergence caught while a step is still in progress is
    reported as the step after the last published one (exact when step
    indices are consecutive, as in the built-in engine).
    """
    rec = _recorder
    if rec is not None:
        rec.begin_step(step_index)


def attach_inband(group: Any) -> None:
    """Use ``group`` (a gloo group over the TP ranks) for the in-band check."""
    rec = _recorder
    if rec is not None and rec.spec.inband_every:
        rec.attach_inband(group)


_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def rank_consensus(
    fn: Callable | None = None,
    *,
    args: Sequence[str] = (),
    result: bool = True,
    kind: str | None = None,
) -> Callable:
    """Record each call of the decorated function as a consensus event.

    The event's kind is ``kind`` or the function's qualified name; its payload
    holds the chosen arguments (``args``, by parameter name) and the result
    (``result=True``), or the exception's type when the call raised.  Bare
    ``@rank_consensus`` records the result only: arguments such as ``self``
    have no canonical encoding.
    """

    def decorate(func: Callable) -> Callable:
        params = inspect.signature(func).parameters
        names = list(params)
        picks: list[tuple[str, int | None, Any]] = []
        for name in args:
            param = params.get(name)
            if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"{func.__qualname__} has no named parameter {name!r}")
            position = names.index(name) if param.kind in _POSITIONAL else None
            picks.append((name, position, param.default))
        label = kind or func.__qualname__

        @functools.wraps(func)
        def wrapper(*a: Any, **kw: Any) -> Any:
            if compiled.is_compiling():  # traced by torch.compile: nothing of ours in its graph (compiled)
                return func(*a, **kw)
            rec = _recorder
            if rec is None:
                return func(*a, **kw)
            chosen = {}
            for name, position, default in picks:
                if position is not None and position < len(a):
                    chosen[name] = a[position]
                elif name in kw:
                    chosen[name] = kw[name]
                else:
                    chosen[name] = None if default is _EMPTY else default
            try:
                value = func(*a, **kw)
            except BaseException as exc:
                rec.record(label, {"args": chosen, "raised": type(exc).__name__})
                raise
            payload: dict[str, Any] = {}
            if picks:
                payload["args"] = chosen
            if result:
                payload["result"] = value
            rec.record(label, payload)
            return value

        return wrapper

    return decorate(fn) if fn is not None else decorate


configure()
