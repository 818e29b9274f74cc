"""Executes step plans on one rank: KV caches, the forward pass, local sampling.

The runner is the same in both control planes: it receives a
:class:`StepPlan` (from its own scheduler or from rank 0) and returns one
sampled token per batch item.  It keeps per-sequence state only (KV cache,
sampling parameters and generator) and frees it when a plan releases it.
"""

from __future__ import annotations

import torch

from . import instrument
from .inject import FaultInjector
from .log import get_logger
from .model import LlamaShard, SeqKV, Span
from .sampling import make_generator, sample
from .scheduler import SamplingParams, StepPlan

log = get_logger()


class PlanMismatch(RuntimeError):
    """A plan does not fit this rank's sequence state (ranks out of step)."""


class _SeqState:
    __slots__ = ("cache", "params", "generator")

    def __init__(self, cache: SeqKV, params: SamplingParams, generator: torch.Generator):
        self.cache = cache
        self.params = params
        self.generator = generator


class ModelRunner:
    def __init__(self, model: LlamaShard, injector: FaultInjector):
        self.model = model
        self.device = model.device
        self.vocab_size = model.cfg.vocab_size
        self._injector = injector
        self._seqs: dict[str, _SeqState] = {}

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            state = self._seqs.pop(seq_id, None)
            if state is not None:
                state.cache.release()

    def execute(self, plan: StepPlan) -> list[int]:
        """Run ``plan``; returns the token sampled for each item (from its last position)."""
        self.release(plan.release)
        if not plan.items:
            return []
        ids: list[int] = []
        positions: list[int] = []
        spans: list[Span] = []
        states: list[_SeqState] = []
        for item in plan.items:
            if item.params is not None:  # a prefill item
                if item.seq_id in self._seqs:
                    raise PlanMismatch(f"step {plan.index}: sequence {item.seq_id} prefilled twice")
                state = _SeqState(self.model.new_cache(), item.params, make_generator(item.params.seed, self.device))
                self._seqs[item.seq_id] = state
            else:
                known = self._seqs.get(item.seq_id)
                if known is None:
                    raise PlanMismatch(f"step {plan.index}: unknown sequence {item.seq_id}")
                state = known
            if item.start != state.cache.length:
                raise PlanMismatch(
                    f"step {plan.index}: sequence {item.seq_id} resumes at {item.start}, "
                    f"its cache holds {state.cache.length} positions"
                )
            spans.append(Span(state.cache, item.start, len(item.token_ids), len(ids)))
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + len(item.token_ids)))
            states.append(state)
        instrument.phase("decode" if not any(it.is_prefill for it in plan.items) else "prefill")
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        last = torch.tensor([sp.offset + sp.length - 1 for sp in spans], dtype=torch.int64, device=self.device)
        logits = self.model.forward(ids_t, pos_t, spans, last)
        instrument.phase("sample")
        tokens = sample(logits, [s.params for s in states], [s.generator for s in states])
        if self._injector.diverge_token():
            diverged = (tokens[0] + 1) % self.vocab_size
            log.warning(
                "inject: diverging token", kind="diverge_token", step=plan.index, sampled=tokens[0], used=diverged
            )
            tokens[0] = diverged
        return tokens
