"""Fault injection for drills: ``--inject KIND@RANK[:STEP]`` (torch-free).

STEP counts *decode steps* from the first request: engine steps that decode at
least one sequence (a prefill-only step does not count), 1-based, the same
count on every rank.  Each injection fires on its rank only, at that step:

=================  ==========================================================
hang_collective    skips one all-reduce of the forward pass, then blocks for
                   ever outside any collective (peers block inside it)
hang_scheduler     stalls for ever in ``_injected_scheduler_stall`` (scheduling
                   phase, outside collectives)
stop               SIGSTOPs itself
crash              raises :class:`InjectedFault` (a Python exception)
exit               ``os._exit(1)``
segfault           reads address 0 (SIGSEGV)
abort              calls native ``abort()`` from a non-main thread (SIGABRT)
diverge_token      samples a different token (``(token + 1) % vocab``)
diverge_batch      drops the newest sequence from its batch for that step
slow               sleeps ``SLOW_STEP_DELAY_S`` in every step from then on
=================  ==========================================================

``poison@RANK`` (no STEP) is triggered by a request instead of a step: RANK
raises :class:`InjectedFault` at the start of every step that prefills a
prompt containing ``POISON_MARKER`` (the prompt ids decoded with the
model's tokenizer; a chat request's rendered prompt carries its messages'
text).  It makes a poison request for tests and drills: the same request
crashes the group every time it is scheduled, any other request is served.
``KINDS`` lists the step kinds (``supervise drill`` runs each as
``KIND@1:STEP``); ``ALL_KINDS`` adds the request-triggered ones.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass

from .log import get_logger

KINDS = (
    "hang_collective",
    "hang_scheduler",
    "stop",
    "crash",
    "exit",
    "segfault",
    "abort",
    "diverge_token",
    "diverge_batch",
    "slow",
)
REQUEST_KINDS = ("poison",)  # triggered by a request's content, not a step: KIND@RANK
ALL_KINDS = KINDS + REQUEST_KINDS
POISON_MARKER = "TPS_POISON"
# Faults that end or freeze the process at the start of the step.
PROCESS_KINDS = ("hang_scheduler", "stop", "crash", "exit", "segfault", "abort")
SLOW_STEP_DELAY_S = 0.2
INJECTED_EXIT_CODE = 1

log = get_logger()


class InjectedFault(RuntimeError):
    """The ``crash`` injection: an ordinary Python exception out of the engine loop."""


@dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    step: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ALL_KINDS:
            raise ValueError(f"unknown inject kind {self.kind!r} (kinds: {', '.join(ALL_KINDS)})")
        if self.rank < 0:
            raise ValueError(f"inject rank must be >= 0, got {self.rank}")
        if self.step < 1:
            raise ValueError(f"inject step must be >= 1, got {self.step}")

    @classmethod
    def parse(cls, text: str) -> Injection:
        """``KIND@RANK[:STEP]`` -> Injection; ValueError with the expected format otherwise."""
        kind, sep, rest = text.strip().partition("@")
        if not sep or not kind or not rest:
            raise ValueError(f"--inject {text!r}: expected KIND@RANK[:STEP], e.g. crash@1:5")
        rank_text, colon, step_text = rest.partition(":")
        if colon and kind in REQUEST_KINDS:
            raise ValueError(f"--inject {text!r}: {kind} is triggered by a request, not a step: {kind}@RANK")
        try:
            rank = int(rank_text)
            step = int(step_text) if step_text else 1
        except ValueError:
            raise ValueError(f"--inject {text!r}: RANK and STEP must be integers") from None
        return cls(kind=kind, rank=rank, step=step)

    def __str__(self) -> str:
        if self.kind in REQUEST_KINDS:
            return f"{self.kind}@{self.rank}"
        return f"{self.kind}@{self.rank}:{self.step}"


def _injected_scheduler_stall() -> None:
    """hang_scheduler: block for ever, in the scheduler, outside any collective."""
    threading.Event().wait()


def _injected_collective_skip() -> None:
    """hang_collective: the all-reduce this rank should be in was skipped; block for ever."""
    threading.Event().wait()


def _injected_slow_step(delay_s: float) -> None:
    time.sleep(delay_s)


def _injected_segfault() -> None:
    ctypes.string_at(0)


def _injected_abort() -> None:
    """Native abort() from a non-main thread: no Python handler runs."""
    libc = ctypes.CDLL(None)
    thread = threading.Thread(target=libc.abort, name="engine-injected-abort", daemon=True)
    thread.start()
    thread.join()
    threading.Event().wait()  # abort() never returns; do not run on meanwhile


class FaultInjector:
    """The injections of one rank and the decode-step counter they refer to.

    ``begin_step(has_decode)`` is called once per engine step on every rank
    (with the batch it is about to run); the other methods ask whether an
    injection fires at the current step.  ``check_prompts(prompts)`` gets the
    token ids of the step's prefills (``poison``; ``decode`` turns ids into
    text, given only to a rank with a poison injection).
    """

    def __init__(self, injections: tuple[Injection, ...], rank: int, decode=None):
        self._mine = tuple(i for i in injections if i.rank == rank)
        self.rank = rank
        self._decode = decode if any(i.kind == "poison" for i in self._mine) else None
        self.wants_prompts = self._decode is not None  # show this rank the prefills' token ids (poison)
        self.decode_step = 0
        self._active_step = False  # the current engine step is a decode step
        self._slow_from: int | None = min((i.step for i in self._mine if i.kind == "slow"), default=None)
        self._skip_armed = False

    @property
    def injections(self) -> tuple[Injection, ...]:
        return self._mine

    def _fires(self, kind: str) -> bool:
        return self._active_step and any(i.kind == kind and i.step == self.decode_step for i in self._mine)

    def begin_step(self, has_decode: bool) -> None:
        """Count the step; arm the collective skip; run process-level faults."""
        self._active_step = has_decode
        if has_decode:
            self.decode_step += 1
        if not self._mine:
            return
        if self._fires("hang_collective"):
            self._skip_armed = True
        for kind in PROCESS_KINDS:
            if self._fires(kind):
                self._process_fault(kind)
        if self._slow_from is not None and self.decode_step >= self._slow_from:
            _injected_slow_step(SLOW_STEP_DELAY_S)

    def _process_fault(self, kind: str) -> None:
        log.warning("inject: firing", kind=kind, rank=self.rank, decode_step=self.decode_step)
        if kind == "hang_scheduler":
            _injected_scheduler_stall()
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "crash":
            raise InjectedFault(f"injected crash on rank {self.rank} at decode step {self.decode_step}")
        elif kind == "exit":
            os._exit(INJECTED_EXIT_CODE)
        elif kind == "segfault":
            _injected_segfault()
        elif kind == "abort":
            _injected_abort()

    def check_prompts(self, prompts) -> None:
        """poison: raise when a prompt about to be prefilled carries ``POISON_MARKER``."""
        if self._decode is None:
            return
        for ids in prompts:
            if POISON_MARKER in self._decode(list(ids)):
                log.warning("inject: firing", kind="poison", rank=self.rank, decode_step=self.decode_step)
                raise InjectedFault(f"injected poison on rank {self.rank}: a scheduled prompt carries {POISON_MARKER}")

    def take_collective_skip(self) -> bool:
        """True once, for the first collective of a hang_collective step."""
        if not self._skip_armed:
            return False
        self._skip_armed = False
        log.warning(
            "inject: skipping a collective", kind="hang_collective", rank=self.rank, decode_step=self.decode_step
        )
        return True

    def block_after_skip(self) -> None:
        _injected_collective_skip()

    def diverge_token(self) -> bool:
        return self._fires("diverge_token")

    def diverge_batch(self) -> bool:
        return self._fires("diverge_batch")
