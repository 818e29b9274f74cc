"""Continuous-batching scheduler (torch-free, deterministic).

Every step the scheduler builds one :class:`StepPlan`: a decode item for each
running sequence, then prefill items for waiting sequences while the batch has
room (``max_batch`` sequences, ``max_batch_tokens`` prompt tokens).  Requests
join and leave the running batch between steps.

``schedule()`` does not change sequence state; ``complete(plan, tokens)``
applies the step's result (admission, appended token, stop decision).  That
split keeps the scheduler a pure function of its inputs, which is what the
replicated control plane relies on (every rank must decide the same batch
from the same inputs) and lets a diverging rank run a modified plan.

A request marked ``isolate`` (a suspect of a failed attempt: the supervisor
lists its fingerprint under ``suspects`` in ``quarantine.json``; docs/engine.md,
"Serving through faults") is prefilled alone: its step holds no other item,
neither another prefill nor the running sequences' decodes (they resume the
step after, one step late).  A suspect that is not first in line ends the
step's prefills, so it heads the next one and waiting order holds.  If that
step fails the group, the supervisor sees it as the only request the failing
step started, so a request that merely arrived with the poison is never
blamed with it.

A resumed request (``resume_ids``: tokens an attempt that failed already
generated) is prefilled with its prompt and those tokens and counts them as
output: the sequence continues where the client's stream stopped.

Stop rules, checked after each sampled token: the sampler failed for this
sequence -> "error"; EOS (unless ``ignore_eos``) -> "stop"; ``max_tokens``
generated -> "length"; the context is full -> "length".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

WIRE_VERSION = 1
MIN_TEMPERATURE = 1e-5  # below this a temperature is greedy (logits / 1e-39 overflow float32)
SAMPLE_FAILED = -1  # the token the sampler reports for a sequence it could not sample


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    fingerprint: str = ""  # engine/runfiles.py: hex digest of model + prompt + sampling parameters, never the text
    isolate: bool = False  # a suspect of a failed attempt: prefilled alone in its step
    # Tokens an earlier attempt already generated (and the client received): prefilled after the
    # prompt, counted as output (max_tokens, usage); the sequence continues from them.
    resume_ids: tuple[int, ...] = ()

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.resume_ids if self.resume_ids else self.prompt_ids


@dataclass(frozen=True)
class BatchItem:
    """Run ``token_ids`` for sequence ``seq_id`` at positions ``start ..``.

    ``params`` is set on prefill items only: a worker that never saw the
    request learns its sampling parameters there.
    """

    seq_id: str
    start: int
    token_ids: tuple[int, ...]
    params: SamplingParams | None = None

    @property
    def is_prefill(self) -> bool:
        return self.params is not None


@dataclass(frozen=True)
class StepPlan:
    """One engine step: what to release, then what to run.  The broadcast plane's wire payload."""

    index: int
    items: tuple[BatchItem, ...]
    release: tuple[str, ...] = ()
    version: int = WIRE_VERSION

    @property
    def has_decode(self) -> bool:
        return any(not it.is_prefill for it in self.items)

    def without_last(self) -> StepPlan:
        return replace(self, items=self.items[:-1])

    def describe(self) -> list[list]:
        """Batch composition for consensus: [seq_id, start, n_tokens] per item."""
        return [[it.seq_id, it.start, len(it.token_ids)] for it in self.items]


@dataclass(frozen=True)
class SeqOutput:
    seq_id: str
    token_id: int
    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int
    max_batch_tokens: int
    max_context: int
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_batch_tokens < 1 or self.max_context < 2:
            raise ValueError("max_batch, max_batch_tokens must be >= 1 and max_context >= 2")


@dataclass
class _Seq:
    request: Request
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.output)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._release: list[str] = []
        self._steps = 0

    # -- inputs ------------------------------------------------------------
    def add(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        if len(request.prefill_ids) >= self.config.max_context:
            raise ValueError(f"prompt of {len(request.prefill_ids)} tokens does not fit the context")
        self._waiting.append(_Seq(request, output=list(request.resume_ids)))

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence wherever it is; True when it was known.

        The id is released either way: a prefill may have created its KV cache.
        """
        known = self._running.pop(seq_id, None) is not None
        for seq in self._waiting:
            if seq.request.request_id == seq_id:
                self._waiting.remove(seq)
                known = True
                break
        if known:
            self._release.append(seq_id)
        return known

    # -- state -------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def pending_release(self) -> tuple[str, ...]:
        return tuple(self._release)

    # -- decisions ---------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to run.  No state changes."""
        items: list[BatchItem] = []
        for seq in self._running.values():
            items.append(BatchItem(seq.request.request_id, seq.computed, (seq.output[-1],)))
        budget = self.config.max_batch_tokens
        prefills = 0
        for seq in self._waiting:
            if len(items) >= self.config.max_batch:
                break
            ids = seq.request.prefill_ids
            n = len(ids)
            if seq.request.isolate:
                if not prefills:  # its own step: no other prefill, no decode
                    items = [BatchItem(seq.request.request_id, 0, ids, seq.request.params)]
                break
            if n > budget and prefills:
                break
            items.append(BatchItem(seq.request.request_id, 0, ids, seq.request.params))
            budget -= n
            prefills += 1
        if not items:
            return None
        return StepPlan(index=self._steps + 1, items=tuple(items), release=tuple(self._release))

    def complete(self, plan: StepPlan, tokens: list[int]) -> list[SeqOutput]:
        """Apply one executed step: ``tokens[i]`` was sampled for ``plan.items[i]``."""
        if len(tokens) != len(plan.items):
            raise ValueError(f"{len(tokens)} tokens for {len(plan.items)} batch items")
        self._steps += 1
        released = set(plan.release)
        self._release = [s for s in self._release if s not in released]
        outputs: list[SeqOutput] = []
        for item, token in zip(plan.items, tokens, strict=True):
            seq = self._running.get(item.seq_id)
            if item.is_prefill:
                seq = self._admit(item.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.computed = item.start + len(item.token_ids)
            seq.output.append(int(token))
            reason = self._finish_reason(seq, int(token))
            if reason is not None:
                del self._running[item.seq_id]
                self._release.append(item.seq_id)
            outputs.append(SeqOutput(item.seq_id, int(token), reason is not None, reason))
        return outputs

    def _admit(self, seq_id: str) -> _Seq | None:
        for seq in self._waiting:
            if seq.request.request_id == seq_id:
                self._waiting.remove(seq)
                self._running[seq_id] = seq
                return seq
        return None

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        params = seq.request.params
        if token == SAMPLE_FAILED:
            return "error"
        if not params.ignore_eos and token in self.config.eos_ids:
            return "stop"
        if len(seq.output) >= params.max_tokens or seq.length >= self.config.max_context:
            return "length"
        return None
