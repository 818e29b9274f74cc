"""One rank's shard of a Llama decoder, in plain torch (Megatron tensor parallelism).

Per layer::

    x ── RMSNorm ── QKV (column-parallel) ── RoPE ── attention ── o_proj (row-parallel) ── all_reduce ──(+x)
      ── RMSNorm ── gate/up (column-parallel) ── SiLU(g)*u ── down (row-parallel) ── all_reduce ──(+x)

The embedding and LM head are vocabulary-parallel: each rank owns a slice of
the rows; embedding lookups outside the slice yield zeros and one all-reduce
sums them; the logits of each slice are all-gathered and the padding trimmed.

A forward pass runs a ragged batch: the tokens of every sequence in the step
are concatenated (prefill prompts and single decode tokens alike) so every
matmul covers the whole batch.  Attention runs once per layer for all
single-token (decode) spans, batched over their KV-cache slots with a padding
mask, and per sequence for multi-token (prefill) spans.  Numerics follow Hugging Face ``LlamaForCausalLM``
(RMSNorm in float32, rotate-half RoPE, SDPA attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .comm import TPComm
from .model_config import ModelConfig, RopeConfig
from .sharding import ShardPlan


@dataclass
class LayerWeights:
    in_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(q_heads + 2 kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, q_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    wgu: torch.Tensor  # [2 * inter_local, hidden]
    wdown: torch.Tensor  # [hidden, inter_local]


@dataclass
class ShardWeights:
    embed: torch.Tensor  # [vocab_rows, hidden]; rows past the real vocabulary are zero
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab_rows, hidden]


class KVPool:
    """This rank's KV cache: one slot of ``max_context`` positions per running sequence.

    Layout ``[layers, slots, kv_heads, max_context, head_dim]`` for keys and
    values.  A fixed slot per sequence lets a decode step gather every
    sequence's keys with one indexing op per layer and run one batched
    attention call.  ``torch.empty`` leaves untouched pages unallocated until
    a slot is first used (each allocation zeroes its slot, see ``allocate``).
    """

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        max_context: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.k = torch.empty(layers, slots, kv_heads, max_context, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.limit = max_context
        self._free = list(range(slots - 1, -1, -1))

    def allocate(self) -> SeqKV:
        if not self._free:
            raise RuntimeError(f"KV cache full: all {self.k.shape[1]} sequence slots are in use")
        slot = self._free.pop()
        # A batched decode step reads every sequence's keys/values up to the
        # longest one and masks the rest; the masked positions must still be
        # finite (0 x NaN is NaN), so a slot never holds leftovers of freed
        # memory or of its previous sequence.
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
        return SeqKV(self, slot)

    def release(self, seq: SeqKV) -> None:
        if seq.slot is not None:
            self._free.append(seq.slot)
            seq.slot = None


class SeqKV:
    """One sequence's slot in the pool and how many positions hold valid keys/values."""

    def __init__(self, pool: KVPool, slot: int):
        self.pool = pool
        self.slot: int | None = slot
        self.length = 0

    def reserve(self, n: int) -> None:
        if self.slot is None:
            raise RuntimeError("sequence cache already released")
        if n > self.pool.limit:
            raise ValueError(f"sequence of {n} tokens exceeds the context limit {self.pool.limit}")

    def release(self) -> None:
        self.pool.release(self)


@dataclass(frozen=True)
class Span:
    """``length`` tokens of one sequence starting at position ``start``, at ``offset`` in the flat batch."""

    cache: SeqKV
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class _DecodeBatch:
    """The single-token spans of a step, gathered once and reused by every layer."""

    rows: torch.Tensor  # offsets in the flat batch
    slots: torch.Tensor
    positions: torch.Tensor
    width: int  # positions to attend over (max position + 1)
    mask: torch.Tensor | None  # [n, 1, 1, width]; None for a single sequence
    contiguous: bool  # rows are 0..n-1: the batch is decode-only, in order


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class LlamaShard:
    def __init__(
        self,
        cfg: ModelConfig,
        shard: ShardPlan,
        weights: ShardWeights,
        comm: TPComm,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
        max_seqs: int,
    ):
        self.cfg = cfg
        self.shard = shard
        self.w = weights
        self.comm = comm
        self.max_context = max_context
        self.device = device
        self.dtype = dtype
        self._q_width = shard.q_heads * cfg.head_dim
        self._kv_width = shard.kv_heads * cfg.head_dim
        positions = torch.arange(max_context, dtype=torch.int64).float()
        freqs = torch.outer(positions, rope_inv_freq(cfg.head_dim, cfg.rope))
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(device=device, dtype=dtype)
        self._sin = emb.sin().to(device=device, dtype=dtype)
        self.kv = KVPool(cfg.num_layers, max_seqs, shard.kv_heads, max_context, cfg.head_dim, dtype, device)

    def new_cache(self) -> SeqKV:
        return self.kv.allocate()

    # -- pieces --------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return F.embedding(ids, self.w.embed)
        local = ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_real_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.w.embed)
        x = x.masked_fill(outside[:, None], 0.0)
        return self.comm.all_reduce(x)

    def _decode_batch(self, spans: list[Span]) -> _DecodeBatch | None:
        decode = [sp for sp in spans if sp.length == 1]
        if not decode:
            return None
        dev = self.device
        positions = [sp.start for sp in decode]
        width = max(positions) + 1
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        mask = None
        if len(decode) > 1:
            mask = (torch.arange(width, device=dev)[None, :] <= pos_t[:, None]).view(len(decode), 1, 1, width)
        rows = [sp.offset for sp in decode]
        return _DecodeBatch(
            rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            slots=torch.tensor([sp.cache.slot for sp in decode], dtype=torch.int64, device=dev),
            positions=pos_t,
            width=width,
            mask=mask,
            contiguous=rows == list(range(len(spans))),
        )

    def _attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[Span], dec: _DecodeBatch | None
    ) -> torch.Tensor:
        kl, vl = self.kv.k[layer], self.kv.v[layer]  # [slots, kv_heads, max_context, head_dim]
        gqa = self.shard.q_heads != self.shard.kv_heads
        dec_out = None
        if dec is not None:
            kl[dec.slots, :, dec.positions] = k[dec.rows]
            vl[dec.slots, :, dec.positions] = v[dec.rows]
            keys = kl[dec.slots, :, : dec.width]  # [n, kv_heads, width, head_dim]
            values = vl[dec.slots, :, : dec.width]
            query = q[dec.rows].unsqueeze(2)  # [n, heads, 1, head_dim]
            dec_out = F.scaled_dot_product_attention(query, keys, values, attn_mask=dec.mask, enable_gqa=gqa)
            dec_out = dec_out.reshape(len(dec.rows), self._q_width)
            if dec.contiguous:
                return dec_out
        out = q.new_empty(q.shape[0], self._q_width)
        if dec is not None and dec_out is not None:
            out[dec.rows] = dec_out
        for sp in spans:
            if sp.length == 1:
                continue
            end = sp.start + sp.length
            rows = slice(sp.offset, sp.offset + sp.length)
            kl[sp.cache.slot, :, sp.start : end] = k[rows].transpose(0, 1)
            vl[sp.cache.slot, :, sp.start : end] = v[rows].transpose(0, 1)
            keys = kl[sp.cache.slot, :, :end].unsqueeze(0)
            values = vl[sp.cache.slot, :, :end].unsqueeze(0)
            query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
            if sp.start == 0:
                res = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=gqa)
            else:
                qpos = torch.arange(sp.start, end, device=q.device)[:, None]
                mask = torch.arange(end, device=q.device)[None, :] <= qpos
                res = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=gqa)
            out[rows] = res[0].transpose(0, 1).reshape(sp.length, self._q_width)
        return out

    # -- forward -------------------------------------------------------------
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, spans: list[Span], logit_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Run a ragged batch; returns float32 logits [len(logit_rows) or tokens, vocab].

        ``ids``/``positions``: [tokens] int64; ``spans`` describe which rows
        belong to which sequence.  KV caches are written for every token.
        """
        cfg = self.cfg
        for sp in spans:
            sp.cache.reserve(sp.start + sp.length)
        dec = self._decode_batch(spans)
        x = self._embed(ids)
        cos, sin = self._cos[positions], self._sin[positions]
        n = ids.shape[0]
        for i, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.in_norm, cfg.rms_norm_eps)
            q, k, v = F.linear(h, lw.wqkv).split((self._q_width, self._kv_width, self._kv_width), dim=-1)
            q = apply_rope(q.view(n, self.shard.q_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(n, self.shard.kv_heads, cfg.head_dim), cos, sin)
            v = v.view(n, self.shard.kv_heads, cfg.head_dim)
            attn = self._attention(i, q, k, v, spans, dec)
            x = x + self.comm.all_reduce(F.linear(attn, lw.wo))
            h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, lw.wgu).chunk(2, dim=-1)
            x = x + self.comm.all_reduce(F.linear(F.silu(gate) * up, lw.wdown))
        for sp in spans:
            sp.cache.length = max(sp.cache.length, sp.start + sp.length)
        if logit_rows is not None:
            x = x[logit_rows]
        x = rms_norm(x, self.w.norm, cfg.rms_norm_eps)
        logits = self.comm.all_gather_last_dim(F.linear(x, self.w.lm_head))
        return logits[:, : cfg.vocab_size].float()
