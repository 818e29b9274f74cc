"""Weights of one rank's shard: seeded random, or read from safetensors slices.

Checkpoint loading reads only this rank's rows/columns of each tensor
(``safe_open(...).get_slice``), so a rank never materialises the full model.
The random model draws every full tensor from one seeded generator in a fixed
order and keeps its slice: the same seed gives the same model at any TP size.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from .model import LayerWeights, ShardWeights
from .model_config import ModelConfig
from .sharding import ShardPlan

RANDOM_INIT_STD = 0.02


class CheckpointError(RuntimeError):
    """The safetensors files do not hold the tensors config.json promises."""


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros(rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


class _ShardSlicer:
    """Cuts one rank's pieces out of full-shape tensors, from any source."""

    def __init__(self, cfg: ModelConfig, shard: ShardPlan):
        self.cfg = cfg
        self.shard = shard
        d = cfg.head_dim
        self.q_rows = (shard.q_head_start * d, (shard.q_head_start + shard.q_heads) * d)
        self.kv_rows = (shard.kv_head_start * d, (shard.kv_head_start + shard.kv_heads) * d)
        self.inter = (shard.inter_start, shard.inter_end)
        self.vocab = (shard.vocab_start, shard.vocab_end)


def _assemble(get, cfg: ModelConfig, shard: ShardPlan, dtype: torch.dtype, device: torch.device) -> ShardWeights:
    """``get(name, rows=None, cols=None)`` returns the (sliced) tensor of HF parameter ``name``."""
    sl = _ShardSlicer(cfg, shard)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=dtype).contiguous().to(device)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        wqkv = torch.cat(
            [
                get(p + "self_attn.q_proj.weight", rows=sl.q_rows),
                get(p + "self_attn.k_proj.weight", rows=sl.kv_rows),
                get(p + "self_attn.v_proj.weight", rows=sl.kv_rows),
            ]
        )
        wgu = torch.cat([get(p + "mlp.gate_proj.weight", rows=sl.inter), get(p + "mlp.up_proj.weight", rows=sl.inter)])
        layers.append(
            LayerWeights(
                in_norm=put(get(p + "input_layernorm.weight")),
                wqkv=put(wqkv),
                wo=put(get(p + "self_attn.o_proj.weight", cols=sl.q_rows)),
                post_norm=put(get(p + "post_attention_layernorm.weight")),
                wgu=put(wgu),
                wdown=put(get(p + "mlp.down_proj.weight", cols=sl.inter)),
            )
        )
    embed = put(_pad_rows(get("model.embed_tokens.weight", rows=sl.vocab), shard.vocab_rows))
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = put(_pad_rows(get("lm_head.weight", rows=sl.vocab), shard.vocab_rows))
    return ShardWeights(embed=embed, layers=layers, norm=put(get("model.norm.weight")), lm_head=lm_head)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            }
        )
    return shapes


def random_weights(
    cfg: ModelConfig, shard: ShardPlan, seed: int, dtype: torch.dtype, device: torch.device
) -> ShardWeights:
    gen = torch.Generator().manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    for name, shape in _expected_shapes(cfg).items():
        if len(shape) == 1:
            full[name] = torch.ones(shape)
        else:
            full[name] = torch.randn(shape, generator=gen) * RANDOM_INIT_STD

    def get(name, rows=None, cols=None):
        t = full[name]
        if rows is not None:
            t = t[rows[0] : rows[1]]
        if cols is not None:
            t = t[:, cols[0] : cols[1]]
        return t

    return _assemble(get, cfg, shard, dtype, device)


def _index_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (from the index when present, else by scanning headers)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / fname for name, fname in weight_map.items()}
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                where[name] = path
    return where


def load_weights(
    model_dir: str | Path, cfg: ModelConfig, shard: ShardPlan, dtype: torch.dtype, device: torch.device
) -> ShardWeights:
    from safetensors import safe_open

    model_dir = Path(model_dir)
    where = _index_files(model_dir)
    expected = _expected_shapes(cfg)
    missing = [n for n in expected if n not in where]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors, e.g. {missing[0]} ({len(missing)} missing)")
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(str(p), framework="pt")) for p in set(where.values())}

        def get(name, rows=None, cols=None):
            sl = handles[where[name]].get_slice(name)
            shape = tuple(sl.get_shape())
            if shape != expected[name]:
                raise CheckpointError(f"{name}: shape {shape}, config.json implies {expected[name]}")
            if rows is not None and cols is not None:
                return sl[rows[0] : rows[1], cols[0] : cols[1]]
            if rows is not None:
                return sl[rows[0] : rows[1]]
            if cols is not None:
                return sl[:, cols[0] : cols[1]]
            return sl[:]

        return _assemble(get, cfg, shard, dtype, device)
