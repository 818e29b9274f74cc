"""A tiny random Llama checkpoint with a real tokenizer, made locally (no hub): what the real-engine tests serve.

    python make_tiny_llama.py DIR

The tokenizer is a word-level one trained with ``tokenizers`` on a small built-in text, wrapped as a
``PreTrainedTokenizerFast`` with bos/eos/unk/pad and a chat template, so vLLM serves completions and chat.
Deterministic (fixed seed).  2 KV heads: divisible by TP=2.
"""

import sys

WORDS = (
    "the quick brown fox jumps over the lazy dog while a tensor parallel group of ranks waits in a collective "
    "every rank must run the same sequence of collectives with the same shapes in the same order one rank "
    "stopped and its peers spin inside an all reduce that looks like useful work the supervisor names the rank "
    "that is somewhere else and leaves no process behind hello world tell me a story about a small model"
    # the characters of JSON, each a token of its own: a JSON-schema request (structured output) can be served
    ' { } [ ] " : , - . 0 1 2 3 4 5 6 7 8 9 true false null a b c'
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make(path: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordLevelTrainer(special_tokens=special))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=max(256, len(fast)),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: one the CPU attention kernels support (16 is refused)
        num_key_value_heads=2,
        max_position_embeddings=4096,  # the context the tests serve (a 4096-token limit, as issue 43 runs it)
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


if __name__ == "__main__":
    make(sys.argv[1])
