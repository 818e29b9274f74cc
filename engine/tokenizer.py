"""Tokenizers (torch-free): a byte-level one for the random model, ``tokenizers`` for checkpoints.

Both expose ``encode(text, add_special_tokens=True) -> list[int]`` (special
tokens such as BOS added as the model expects, unless a chat template wrote
them already), ``decode(ids) -> str`` (special tokens skipped) and
``vocab_size``.  :class:`IncrementalDecoder` turns a growing token list into
text deltas for streaming without emitting half a UTF-8 character.
"""

from __future__ import annotations

from pathlib import Path

from .model_config import BYTE_BOS, BYTE_EOS, BYTE_VOCAB

REPLACEMENT_CHAR = "\ufffd"


class ByteTokenizer:
    """One token per UTF-8 byte, plus BOS (256) and EOS (257)."""

    vocab_size = BYTE_VOCAB
    bos_id = BYTE_BOS
    eos_ids = (BYTE_EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = list(text.encode("utf-8"))
        return [self.bos_id, *data] if add_special_tokens else data

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, vocab_size: int):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)


def load_tokenizer(model_dir: str | None, vocab_size: int):
    if model_dir is None:
        return ByteTokenizer()
    return HFTokenizer(Path(model_dir) / "tokenizer.json", vocab_size)


class IncrementalDecoder:
    """Text deltas of a growing token sequence.

    Decodes the whole sequence each time (outputs are short) and holds back a
    trailing replacement character, which usually means an incomplete
    multi-byte character that the next token completes.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""

    def push(self, ids: list[int], final: bool = False) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        self.text = text
        end = len(text)
        if not final:
            while end > self._emitted and text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
        delta = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
