"""One rank of the HF-parity check (run with the torchrun environment, or called in-process at TP=1).

Computes our shard's logits for fixed prompts two ways and, on rank 0, saves
them with torch.save:

* ``full-<i>``: one prefill of prompt i, logits at every position;
* ``ragged-<i>``: all prompts in one ragged batch, prefilling the first half
  of each, then teacher-forced decode steps over the whole batch (sequences
  of different lengths, KV caches growing) -- concatenated, the logits must
  equal the full forward's.

    python tests/engine/parity_rank.py OUT.pt '[[1,5,9], ...]' MODEL_DIR [MODEL_DIR ...]

(one process group for all checkpoints; the saved dict maps each MODEL_DIR
to its results)
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tp_supervise.engine.args import DistEnv
from tp_supervise.engine.comm import TPComm, destroy_groups, init_groups
from tp_supervise.engine.model import LlamaShard, Span
from tp_supervise.engine.model_config import ModelConfig
from tp_supervise.engine.sharding import plan_shards
from tp_supervise.engine.weights import load_weights

MAX_CONTEXT = 128
MAX_SEQS = 8


def build(model_dir: str, dist_env: DistEnv, group=None) -> LlamaShard:
    cfg = ModelConfig.from_dir(model_dir)
    shard = plan_shards(cfg, dist_env.world_size, dist_env.rank)
    weights = load_weights(model_dir, cfg, shard, torch.float32, torch.device("cpu"))
    return LlamaShard(cfg, shard, weights, TPComm(group, dist_env.world_size), MAX_CONTEXT,
                      torch.device("cpu"), torch.float32, max_seqs=MAX_SEQS)


@torch.inference_mode()
def compute(model: LlamaShard, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, prompt in enumerate(prompts):
        cache = model.new_cache()
        out[f"full-{i}"] = model.forward(torch.tensor(prompt), torch.arange(len(prompt)),
                                         [Span(cache, 0, len(prompt), 0)], None)
        cache.release()
    caches = [model.new_cache() for _ in prompts]
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = [max(1, len(p) // 2) for p in prompts]
    ids, pos, spans = [], [], []
    for i, prompt in enumerate(prompts):
        spans.append(Span(caches[i], 0, done[i], len(ids)))
        ids += prompt[: done[i]]
        pos += list(range(done[i]))
    logits = model.forward(torch.tensor(ids), torch.tensor(pos), spans, None)
    for i, sp in enumerate(spans):
        pieces[i].append(logits[sp.offset: sp.offset + sp.length])
    while True:
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        if not active:
            break
        spans = [Span(caches[i], done[i], 1, k) for k, i in enumerate(active)]
        logits = model.forward(torch.tensor([prompts[i][done[i]] for i in active]),
                               torch.tensor([done[i] for i in active]), spans, None)
        for k, i in enumerate(active):
            pieces[i].append(logits[k: k + 1])
            done[i] += 1
    for i in range(len(prompts)):
        out[f"ragged-{i}"] = torch.cat(pieces[i])
    return out


def main() -> int:
    out_path, prompts, model_dirs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    dist_env = DistEnv.from_environ(os.environ)
    group, _ = init_groups(dist_env, "cpu")
    result = {d: compute(build(d, dist_env, group), prompts) for d in model_dirs}
    if dist_env.rank == 0:
        torch.save(result, out_path)
    destroy_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
