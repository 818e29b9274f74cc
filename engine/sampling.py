"""Token sampling: greedy, or temperature + top-p with a per-sequence seeded generator.

Every rank samples from the same all-gathered logits with a generator seeded
from the request, so healthy ranks draw the same token without communicating
(the consensus checker compares them; ``--sync-token-ids`` enforces it).
"""

from __future__ import annotations

import torch

from engine.scheduler import SamplingParams

SEED_MASK = (1 << 64) - 1


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & SEED_MASK)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token per row of ``logits`` [rows, vocab] (float32)."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy[row])
            continue
        probs = torch.softmax(logits[row] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=gen)
            out.append(int(order[choice].item()))
        else:
            out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
