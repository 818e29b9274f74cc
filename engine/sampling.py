"""Token sampling: greedy, or temperature + top-p with a per-sequence seeded generator.

Every rank samples from the same all-gathered logits with a generator seeded
from the request, so healthy ranks draw the same token without communicating
(the consensus checker compares them; ``--sync-token-ids`` enforces it).

Sampling is numerically safe for every value the API accepts: a temperature
below ``MIN_TEMPERATURE`` is greedy (dividing by 1e-39 overflows float32),
logits are shifted by their maximum before scaling so the softmax never sees
``inf``, and top-p always keeps the most likely token (a float32 compare of
``top_p=1e-300`` would otherwise mask every token).  A row that still cannot
be sampled (non-finite logits) yields ``SAMPLE_FAILED`` for that sequence
only: the input is identical on every rank, so every rank fails it the same
way and the request is answered with an error while the engine keeps serving.
"""

from __future__ import annotations

import torch

from .log import get_logger
from .scheduler import SAMPLE_FAILED, SamplingParams

SEED_MASK = (1 << 64) - 1

log = get_logger()


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & SEED_MASK)
    return gen


def _draw(row: torch.Tensor, best: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax((row - best) / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p, and always the top token
        drop = cumulative - sorted_probs >= p.top_p
        drop[0] = False
        choice = torch.multinomial(sorted_probs.masked_fill(drop, 0.0), 1, generator=gen)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token per row of ``logits`` [rows, vocab] (float32); ``SAMPLE_FAILED`` for a row that cannot be sampled."""
    best, argmax = logits.max(dim=-1)
    finite: list[bool] = torch.isfinite(best).tolist()  # a NaN anywhere in a row makes its max NaN
    greedy: list[int] = argmax.tolist()
    out: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not finite[row]:
            log.warning("sampling failed: non-finite logits", row=row)
            token = SAMPLE_FAILED
        elif p.greedy:
            token = greedy[row]
        else:
            try:
                token = _draw(logits[row], best[row], p, gen)
            except RuntimeError as exc:  # torch's multinomial refusing a distribution
                log.warning("sampling failed", error=str(exc), temperature=p.temperature, top_p=p.top_p)
                token = SAMPLE_FAILED
        out.append(token)
    return out
