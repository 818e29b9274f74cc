"""Write a small random Hugging Face Llama checkpoint (needs ``transformers``, a dev dependency).

Used by the HF-parity tests and the benchmark, and handy for trying
``--model DIR`` offline::

    python -m tp_supervise.engine.checkpoint_gen /tmp/llama-tiny --vocab-size 251 --kv-heads 1

The directory gets ``config.json`` + ``model.safetensors`` (``save_pretrained``)
and a ``tokenizer.json``: a word-level tokenizer whose words are ``w<id>``
(ids 0-2 are ``<unk>``, ``<s>``, ``</s>``), with ``<s>`` prepended, so a
prompt such as ``"w5 w9"`` encodes to ``[1, 5, 9]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class CheckpointSpec:
    vocab_size: int = 251
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    max_position_embeddings: int = 512
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    llama3_rope_factor: float | None = None  # None: plain RoPE; else Llama-3 frequency scaling
    llama3_original_max_position: int = 64
    seed: int = 0


def word(token_id: int) -> str:
    return SPECIALS[token_id] if token_id < len(SPECIALS) else f"w{token_id}"


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[BOS_ID]} $A", special_tokens=[(SPECIALS[BOS_ID], BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(path))


def write_random_checkpoint(directory: str | Path, spec: CheckpointSpec = CheckpointSpec()) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fields = asdict(spec)
    seed = fields.pop("seed")
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    factor = fields.pop("llama3_rope_factor")
    original = fields.pop("llama3_original_max_position")
    if factor is not None:
        rope.update(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=original,
        )
    config = LlamaConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, rope_parameters=rope, **fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    write_tokenizer(directory / "tokenizer.json", spec.vocab_size)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    defaults = CheckpointSpec()
    p = argparse.ArgumentParser(
        prog="python -m tp_supervise.engine.checkpoint_gen", description=__doc__.splitlines()[0]
    )
    p.add_argument("directory")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    p.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    p.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=defaults.num_key_value_heads)
    p.add_argument("--max-position", type=int, default=defaults.max_position_embeddings)
    p.add_argument("--init-std", type=float, default=defaults.initializer_range)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=defaults.seed)
    ns = p.parse_args(argv)
    spec = CheckpointSpec(
        vocab_size=ns.vocab_size,
        hidden_size=ns.hidden_size,
        intermediate_size=ns.intermediate_size,
        num_hidden_layers=ns.layers,
        num_attention_heads=ns.heads,
        num_key_value_heads=ns.kv_heads,
        max_position_embeddings=ns.max_position,
        initializer_range=ns.init_std,
        tie_word_embeddings=ns.tie_word_embeddings,
        seed=ns.seed,
    )
    print(write_random_checkpoint(ns.directory, spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
