"""Megatron-style shard plan for one rank (torch-free, pure).

What each rank of a tensor-parallel group of size ``tp`` owns:

* attention: ``num_heads / tp`` query heads (column-parallel QKV, row-parallel
  o_proj).  KV heads are split the same way when ``num_kv_heads >= tp``; when
  there are fewer KV heads than ranks each rank keeps the one KV head its query
  heads read (replicated over ``tp / num_kv_heads`` ranks).
* MLP: a contiguous slice of the intermediate dimension (column-parallel
  gate/up, row-parallel down).  Slices may differ by one column: the
  row-parallel all-reduce sums full-width outputs, so uneven slices are exact.
* vocabulary: ``ceil(vocab / tp)`` rows per rank for the embedding and LM
  head; the last rank's missing rows are zero padding, trimmed after the
  all-gather of the logits.

What cannot be split raises :class:`ShardingError` naming the dimension and
the TP size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over this tensor-parallel size."""


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous slices of ``range(total)`` (sizes differ by <= 1)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardPlan:
    tp_size: int
    rank: int
    head_dim: int
    q_head_start: int
    q_heads: int
    kv_head_start: int
    kv_heads: int
    kv_replicas: int  # ranks holding a copy of each local KV head (1 = no replication)
    inter_start: int
    inter_end: int
    vocab_start: int
    vocab_end: int  # exclusive; rows [vocab_end, vocab_start + vocab_rows) are padding
    vocab_rows: int  # padded rows per rank (equal on every rank, for the all-gather)

    @property
    def vocab_real_rows(self) -> int:
        return self.vocab_end - self.vocab_start


def plan_shards(cfg: ModelConfig, tp: int, rank: int) -> ShardPlan:
    if tp < 1 or not 0 <= rank < tp:
        raise ShardingError(f"rank {rank} is outside a tensor-parallel group of size {tp}")
    if cfg.num_heads % tp:
        raise ShardingError(f"num_attention_heads={cfg.num_heads} is not divisible by the tensor-parallel size {tp}")
    q_heads = cfg.num_heads // tp
    if cfg.num_kv_heads >= tp:
        if cfg.num_kv_heads % tp:
            raise ShardingError(
                f"num_key_value_heads={cfg.num_kv_heads} cannot be split over tensor-parallel size {tp}: "
                f"it must be a multiple of {tp} (or divide {tp}, to replicate KV heads)"
            )
        kv_heads = cfg.num_kv_heads // tp
        kv_start = rank * kv_heads
        replicas = 1
    else:
        if tp % cfg.num_kv_heads:
            raise ShardingError(
                f"num_key_value_heads={cfg.num_kv_heads} cannot be replicated over tensor-parallel size {tp}: "
                f"{tp} is not a multiple of {cfg.num_kv_heads}"
            )
        replicas = tp // cfg.num_kv_heads
        kv_heads = 1
        kv_start = rank // replicas
    inter_start, inter_end = split_range(cfg.intermediate_size, tp, rank)
    vocab_rows = -(-cfg.vocab_size // tp)
    vocab_start = min(rank * vocab_rows, cfg.vocab_size)
    vocab_end = min(vocab_start + vocab_rows, cfg.vocab_size)
    return ShardPlan(
        tp_size=tp,
        rank=rank,
        head_dim=cfg.head_dim,
        q_head_start=rank * q_heads,
        q_heads=q_heads,
        kv_head_start=kv_start,
        kv_heads=kv_heads,
        kv_replicas=replicas,
        inter_start=inter_start,
        inter_end=inter_end,
        vocab_start=vocab_start,
        vocab_end=vocab_end,
        vocab_rows=vocab_rows,
    )


def check_shardable(cfg: ModelConfig, tp: int) -> None:
    """Raise :class:`ShardingError` unless every rank of a size-``tp`` group has a valid shard."""
    for rank in range(tp):
        plan_shards(cfg, tp, rank)
