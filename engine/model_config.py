"""Llama model hyper-parameters (torch-free, so arguments validate before torch loads).

Reads Hugging Face ``config.json`` files of the Llama family: both the older
layout (``rope_theta`` + ``rope_scaling``) and the transformers-5 layout
(``rope_parameters``).  Anything we would silently compute wrong (biases,
another activation, an unknown RoPE type) is rejected with a clear message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_EPS = 1e-6


class ModelConfigError(ValueError):
    """config.json describes a model this engine cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = DEFAULT_ROPE_THETA
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope type {self.kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ModelConfigError("rope theta and factor must be positive")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = DEFAULT_RMS_EPS
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for tok in self.eos_token_ids + ((self.bos_token_id,) if self.bos_token_id is not None else ()):
            if not 0 <= tok < self.vocab_size:
                raise ModelConfigError(f"special token id {tok} is outside the vocabulary ({self.vocab_size})")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        heads = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + heads + self.hidden_size

    @classmethod
    def from_hf(cls, data: dict) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``."""
        archs = data.get("architectures") or []
        model_type = data.get("model_type")
        if model_type != "llama" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ModelConfigError(
                f"model_type={model_type!r} architectures={archs!r}: only Llama checkpoints are supported"
            )
        if data.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={data.get('hidden_act')!r} is not supported (silu only)")
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ModelConfigError(f"{flag}=true is not supported")
        if int(data.get("pretraining_tp", 1) or 1) != 1:
            raise ModelConfigError("pretraining_tp != 1 is not supported")
        try:
            heads = int(data["num_attention_heads"])
            hidden = int(data["hidden_size"])
            cfg = cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(data["intermediate_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                max_position=int(data.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(data.get("rms_norm_eps", DEFAULT_RMS_EPS)),
                rope=_rope_from_hf(data),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                bos_token_id=_optional_int(data.get("bos_token_id")),
                eos_token_ids=_int_tuple(data.get("eos_token_id")),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json has a malformed value: {exc}") from None
        return cfg

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ModelConfigError(f"cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path} is not a JSON object")
        cfg = cls.from_hf(data)
        gen = Path(model_dir) / "generation_config.json"
        if not cfg.eos_token_ids and gen.is_file():
            try:
                extra = _int_tuple(json.loads(gen.read_text()).get("eos_token_id"))
            except (OSError, ValueError, AttributeError):
                extra = ()
            if extra:
                cfg = replace(cfg, eos_token_ids=extra)
        return cfg


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _int_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_from_hf(data: dict) -> RopeConfig:
    params = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", data.get("rope_theta", DEFAULT_ROPE_THETA)))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )


# Seeded random models for running offline.  The byte-level tokenizer has 256
# byte tokens plus BOS and EOS, so the vocabulary is 258.
BYTE_VOCAB = 258
BYTE_BOS = 256
BYTE_EOS = 257

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=1024,
        bos_token_id=BYTE_BOS,
        eos_token_ids=(BYTE_EOS,),
    ),
    "small": ModelConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        max_position=4096,
        bos_token_id=BYTE_BOS,
        eos_token_ids=(BYTE_EOS,),
    ),
}
