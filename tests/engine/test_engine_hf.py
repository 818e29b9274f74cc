"""Our logits against Hugging Face LlamaForCausalLM, at TP=1 (in-process) and TP=2 (two gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

PARITY_RANK = Path(__file__).with_name("parity_rank.py")
PROMPTS = [[1], [1, 17, 4, 250, 99, 3], [1] + [(7 * k + 3) % 240 + 3 for k in range(29)]]
# float32 on both sides; TP only changes the order of reductions.
ATOL = 5e-5
RTOL = 1e-4


def hf_logits(model_dir: Path) -> list[torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


def ours_tp1(model_dir: Path) -> dict:
    from tp_supervise.engine.args import DistEnv
    from tests.engine.parity_rank import build, compute

    return compute(build(str(model_dir), DistEnv()), PROMPTS)



def ours_tp2(model_dirs: list[Path], out: Path) -> dict:
    import os

    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(PARITY_RANK), str(out), json.dumps(PROMPTS),
                                       *map(str, model_dirs)], env=env, stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], errs
    return torch.load(out)


@pytest.fixture(scope="module", params=["ckpt_a", "ckpt_b"])
def checkpoint(request):
    path = request.getfixturevalue(request.param)
    return path, hf_logits(path)


@pytest.fixture(scope="module")
def tp2_results(ckpt_a, ckpt_b, tmp_path_factory) -> dict:
    """Both checkpoints through one 2-rank gloo job (process start-up dominates the cost)."""
    return ours_tp2([ckpt_a, ckpt_b], tmp_path_factory.mktemp("tp2") / "logits.pt")


def check(ours: dict, ref: list[torch.Tensor]) -> None:
    for i, expected in enumerate(ref):
        for kind in ("full", "ragged"):
            got = ours[f"{kind}-{i}"]
            assert got.shape == expected.shape, (kind, i)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{kind}-{i}: {m}")
        # greedy choices identical at every position
        assert torch.equal(ours[f"full-{i}"].argmax(-1), expected.argmax(-1))


def test_logits_match_hf_tp1(checkpoint):
    path, ref = checkpoint
    check(ours_tp1(path), ref)


def test_logits_match_hf_tp2(checkpoint, tp2_results):
    path, ref = checkpoint
    check(tp2_results[str(path)], ref)


def test_loading_reads_only_the_shard(ckpt_a):
    """Each rank's tensors are its slice: vocabulary padded to 126 rows, one replicated KV head."""
    from tp_supervise.engine.model_config import ModelConfig
    from tp_supervise.engine.sharding import plan_shards
    from tp_supervise.engine.weights import load_weights
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dir(ckpt_a)
    full = load_file(str(ckpt_a / "model.safetensors"))
    d = cfg.head_dim
    for rank in range(2):
        shard = plan_shards(cfg, 2, rank)
        w = load_weights(ckpt_a, cfg, shard, torch.float32, torch.device("cpu"))
        assert w.embed.shape == (126, cfg.hidden_size) and w.lm_head.shape == (126, cfg.hidden_size)
        real = shard.vocab_real_rows
        assert torch.equal(w.lm_head[:real], full["lm_head.weight"][shard.vocab_start: shard.vocab_end])
        assert torch.count_nonzero(w.lm_head[real:]) == 0
        layer = w.layers[0]
        q = full["model.layers.0.self_attn.q_proj.weight"][rank * 2 * d: (rank + 1) * 2 * d]
        k = full["model.layers.0.self_attn.k_proj.weight"]  # the single KV head, replicated
        assert torch.equal(layer.wqkv[: 2 * d], q) and torch.equal(layer.wqkv[2 * d: 3 * d], k)
        assert layer.wo.shape == (cfg.hidden_size, 2 * d)


def test_sampling_rules():
    from tp_supervise.engine.sampling import make_generator, sample
    from tp_supervise.engine.scheduler import SamplingParams

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]))
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy, greedy], [None, None]) == [0, 2]
    nucleus = SamplingParams(temperature=1.0, top_p=0.7)  # keeps {0, 1}: 0.5 < 0.7 <= 0.8
    gen = make_generator(3, torch.device("cpu"))
    draws = [sample(logits[:1], [nucleus], [gen])[0] for _ in range(300)]
    assert set(draws) == {0, 1}
    tight = SamplingParams(temperature=1.0, top_p=1e-6)
    assert {sample(logits, [tight, tight], [gen, gen])[1] for _ in range(20)} == {2}
    full = SamplingParams(temperature=1.0)
    a = [sample(logits[:1], [full], [make_generator(9, torch.device("cpu"))])[0] for _ in range(5)]
    g = make_generator(9, torch.device("cpu"))
    seq_a = [sample(logits[:1], [full], [g])[0] for _ in range(50)]
    g = make_generator(9, torch.device("cpu"))
    assert [sample(logits[:1], [full], [g])[0] for _ in range(50)] == seq_a  # same seed, same draws
    assert len(set(seq_a)) == 3 and len(set(a)) == 1


def test_sampling_is_safe_for_every_accepted_value():
    from tp_supervise.engine.sampling import make_generator, sample
    from tp_supervise.engine.scheduler import SAMPLE_FAILED, SamplingParams

    logits = torch.tensor([[3.0, 1.0, -2.0, float("-inf")]])  # -inf: vocabulary padding
    gen = make_generator(1, torch.device("cpu"))
    for temperature, top_p in [(1e-39, 1.0), (1e-320, 0.5), (1e-5, 1.0), (2.0, 1e-300), (1.0, 5e-324)]:
        p = SamplingParams(temperature=temperature, top_p=top_p)
        assert sample(logits, [p], [gen]) == [0], (temperature, top_p)
    broken = torch.tensor([[float("nan"), 1.0, 0.0, 0.0], [0.0, float("inf"), 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    assert sample(broken, params, [gen] * 3) == [SAMPLE_FAILED, SAMPLE_FAILED, 1]  # only the broken rows fail


def test_a_failed_sample_finishes_only_its_sequence():
    from tp_supervise.engine.scheduler import SAMPLE_FAILED, Request, SamplingParams, Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(max_batch=4, max_batch_tokens=64, max_context=32))
    sched.add(Request("a", (1, 2), SamplingParams(max_tokens=4)))
    sched.add(Request("b", (3,), SamplingParams(max_tokens=4)))
    plan = sched.schedule()
    out = sched.complete(plan, [SAMPLE_FAILED, 7])
    assert [(o.seq_id, o.finished, o.finish_reason) for o in out] == [("a", True, "error"), ("b", False, None)]
    assert [it.seq_id for it in sched.schedule().items] == ["b"]
