"""The one place where the engine reports to the supervisor (torch-free).

Everything in ``engine/`` calls these functions and nothing else of the
supervisor:

* ``starting()`` first thing in ``__main__`` (before torch is imported),
  ``ready()`` when serving, ``finished()`` before a clean exit;
* ``step(index)``: one engine step (a scheduler iteration that runs a batch);
  it ends with the consensus ``end_step(index)``;
* ``phase(name)``: where the rank is (schedule, prefill, decode, ...);
* ``record(kind, payload)``: a consensus event (batch composition, sampled
  token ids, stop decisions, received requests).

Collectives are NOT reported here: the supervisor's zero-code hook wraps
``torch.distributed`` and reports them (reporting them twice would double the
collective count).

``record``/``end_step`` go to the rank-side consensus recorder
(``tp_supervise.supervisor.rank.consensus``; a cheap no-op when the rank is
not supervised).  ``configure_trace(dir, rank)`` additionally writes every
event as a JSON line to ``dir/rank-<rank>.jsonl`` (``--trace-events``), to
compare ranks' decisions without a supervisor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tp_supervise.supervisor.rank import consensus as _consensus
from tp_supervise.supervisor.rank import runtime as _sv


class _Sinks:
    trace: TextIO | None = None  # open text file (--trace-events)


_sinks = _Sinks()


def starting() -> None:
    _sv.starting()


def ready() -> None:
    _sv.ready()


def finished() -> None:
    _sv.finished()


def phase(name: str) -> None:
    _sv.phase(name)


def configure_trace(directory: str | None, rank: int) -> None:
    """Also write every consensus event of this rank to ``directory/rank-<rank>.jsonl``."""
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    _sinks.trace = open(os.path.join(directory, f"rank-{rank}.jsonl"), "w", buffering=1)


def record(kind: str, payload: Any) -> None:
    """A consensus event of the current step (cheap no-op when nobody listens)."""
    _consensus.record(kind, payload)
    if _sinks.trace is not None:
        _sinks.trace.write(json.dumps({"kind": kind, "payload": payload}) + "\n")


def end_step(index: int) -> None:
    """Close the consensus record of engine step ``index`` (same index on every rank)."""
    _consensus.end_step(index)
    if _sinks.trace is not None:
        _sinks.trace.write(json.dumps({"end_step": index}) + "\n")


@contextmanager
def step(index: int) -> Iterator[None]:
    """One engine step; consensus ``end_step(index)`` runs only when the step completed."""
    _sv.begin_step()
    try:
        yield
    finally:
        _sv.end_step()
    end_step(index)
