"""Hugging Face transformers tensor-parallel generate loop (run under torchrun).

    torchrun --nproc-per-node 2 hf_tp_generate.py --model DIR [--loops N]
             [--fault stop] [--fault-rank 1] [--fault-at K]

No supervisor code: the zero-code hook sees transformers' collectives.
`--make DIR` (without torchrun) writes a tiny random Llama checkpoint.
"""

import argparse
import os
import signal


def make(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--make")
    p.add_argument("--loops", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-at", type=int, default=5)
    args = p.parse_args()
    if args.make:
        make(args.make)
        return
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    for i in range(args.loops):
        if rank == args.fault_rank and i == args.fault_at and args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
