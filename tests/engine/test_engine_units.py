"""Pure, torch-free parts of the engine: shard plans, config parsing, args, injections."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from tp_supervise.engine.args import DistEnv, parse_args
from tp_supervise.engine.inject import KINDS, FaultInjector, Injection
from tp_supervise.engine.model_config import PRESETS, ModelConfig, ModelConfigError
from tp_supervise.engine.sharding import ShardingError, check_shardable, plan_shards, split_range

TINY = PRESETS["tiny"]


def cfg(**kw) -> ModelConfig:
    return replace(TINY, bos_token_id=None, eos_token_ids=(), **kw)


# -- sharding -----------------------------------------------------------------
@pytest.mark.parametrize("total,parts", [(10, 3), (7, 7), (5, 8), (176, 2), (1, 1)])
def test_split_range_covers_everything_evenly(total, parts):
    ranges = [split_range(total, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_even_split():
    c = cfg(num_heads=8, num_kv_heads=4, vocab_size=256, intermediate_size=64)
    plans = [plan_shards(c, 2, r) for r in range(2)]
    assert [(p.q_head_start, p.q_heads) for p in plans] == [(0, 4), (4, 4)]
    assert [(p.kv_head_start, p.kv_heads, p.kv_replicas) for p in plans] == [(0, 2, 1), (2, 2, 1)]
    assert [(p.vocab_start, p.vocab_end, p.vocab_rows) for p in plans] == [(0, 128, 128), (128, 256, 128)]
    assert [(p.inter_start, p.inter_end) for p in plans] == [(0, 32), (32, 64)]


def test_vocab_not_divisible_is_padded():
    plans = [plan_shards(cfg(vocab_size=251), 2, r) for r in range(2)]
    assert [p.vocab_rows for p in plans] == [126, 126]
    assert [(p.vocab_start, p.vocab_end) for p in plans] == [(0, 126), (126, 251)]
    tiny_vocab = [plan_shards(cfg(vocab_size=5, num_heads=4, num_kv_heads=4), 4, r) for r in range(4)]
    assert [(p.vocab_start, p.vocab_end) for p in tiny_vocab] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_fewer_kv_heads_than_ranks_are_replicated():
    c = cfg(num_heads=8, num_kv_heads=2)
    plans = [plan_shards(c, 4, r) for r in range(4)]
    assert [(p.kv_head_start, p.kv_heads, p.kv_replicas) for p in plans] == [
        (0, 1, 2), (0, 1, 2), (1, 1, 2), (1, 1, 2)]
    # every local query head reads the local KV head (group of 4 query heads per KV head)
    group = c.num_heads // c.num_kv_heads
    for p in plans:
        assert {h // group for h in range(p.q_head_start, p.q_head_start + p.q_heads)} == {p.kv_head_start}
    single = [plan_shards(cfg(num_heads=4, num_kv_heads=1), 2, r) for r in range(2)]
    assert [(p.kv_head_start, p.kv_replicas) for p in single] == [(0, 2), (0, 2)]


def test_uneven_intermediate_is_split_unevenly():
    plans = [plan_shards(cfg(intermediate_size=175), 2, r) for r in range(2)]
    assert [(p.inter_start, p.inter_end) for p in plans] == [(0, 88), (88, 175)]


@pytest.mark.parametrize("kw,tp,needle", [
    (dict(num_heads=6, num_kv_heads=6), 4, "num_attention_heads=6 is not divisible by the tensor-parallel size 4"),
    (dict(num_heads=12, num_kv_heads=6), 4, "num_key_value_heads=6 cannot be split over tensor-parallel size 4"),
    (dict(num_heads=12, num_kv_heads=4), 6, "num_key_value_heads=4 cannot be replicated"),
    (dict(num_heads=12, num_kv_heads=4), 3, "num_key_value_heads=4"),
])
def test_unshardable_shapes_name_the_dimension_and_tp(kw, tp, needle):
    with pytest.raises(ShardingError) as err:
        check_shardable(cfg(**kw), tp)
    assert needle in str(err.value)
    assert str(tp) in str(err.value)


# -- model config ---------------------------------------------------------------
HF_BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 251, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": [2, 3],
}


def test_hf_config_old_and_new_rope_layouts():
    old = ModelConfig.from_hf({**HF_BASE, "rope_theta": 500000.0,
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                "original_max_position_embeddings": 64}})
    new = ModelConfig.from_hf({**HF_BASE, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3",
                                                              "factor": 8.0,
                                                              "original_max_position_embeddings": 64}})
    assert old == new
    assert new.rope.kind == "llama3" and new.rope.theta == 500000.0 and new.rope.original_max_position == 64
    assert new.head_dim == 16 and new.eos_token_ids == (2, 3) and new.rms_norm_eps == 1e-5


@pytest.mark.parametrize("patch,needle", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "only Llama"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "yarn"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"eos_token_id": 999}, "outside the vocabulary"),
])
def test_hf_config_rejects_what_we_cannot_run(patch, needle):
    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_hf({**HF_BASE, **patch})
    assert needle in str(err.value)


def test_hf_config_missing_key():
    data = dict(HF_BASE)
    del data["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelConfig.from_hf(data)


# -- arguments ------------------------------------------------------------------
def test_parse_args_defaults_and_env():
    cfg_, dist_env, model = parse_args([], {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                            "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    assert cfg_.control_plane == "broadcast" and cfg_.device == "cpu" and cfg_.port == 8000
    assert dist_env == DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_port=1234)
    assert model == TINY and cfg_.max_context == TINY.max_position
    cfg_, _, _ = parse_args(["--inject", "crash@1:5", "--inject", "slow@0", "--control-plane", "replicated",
                             "--sync-token-ids"], {"WORLD_SIZE": "2"})
    assert cfg_.injections == (Injection("crash", 1, 5), Injection("slow", 0, 1))


@pytest.mark.parametrize("argv,env,needle", [
    (["--inject", "crash@2"], {"WORLD_SIZE": "2"}, "rank 2 does not exist"),
    (["--inject", "boom@0"], {}, "unknown inject kind"),
    (["--inject", "crash"], {}, "expected KIND@RANK[:STEP]"),
    (["--inject", "crash@0:0"], {}, "step must be >= 1"),
    (["--inject", "crash@x"], {}, "must be integers"),
    (["--inject", "hang_collective@0"], {}, "needs collectives"),
    (["--port", "70000"], {}, "--port 70000"),
    (["--max-batch", "0"], {}, "--max-batch must be >= 1"),
    (["--sync-token-ids"], {}, "only applies to --control-plane replicated"),
    (["--max-context", "5000"], {}, "--max-context 5000"),
    (["--model", "/nonexistent/dir"], {}, "not a directory"),
    ([], {"WORLD_SIZE": "3"}, "num_attention_heads=4 is not divisible by the tensor-parallel size 3"),
    ([], {"RANK": "x"}, "RANK='x' is not an integer"),
])
def test_bad_arguments_exit_2(argv, env, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_model_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path)], {})
    import json
    (tmp_path / "config.json").write_text(json.dumps(HF_BASE))
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path)], {})


def test_cli_rejects_bad_input_quickly_without_torch():
    """The real entry point: exit 2 with a clear message, before torch is imported."""
    code = ("import sys, runpy; sys.argv=['engine', '--inject', 'crash@3'];\n"
            "try:\n    runpy.run_module('engine', run_name='__main__')\n"
            "except SystemExit as e:\n    print('torch' in sys.modules, e.code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["False", "2"], out.stderr
    assert "rank 3 does not exist (WORLD_SIZE=2)" in out.stderr


# -- injections -------------------------------------------------------------------
def test_injection_parse_roundtrip():
    for kind in KINDS:
        inj = Injection.parse(f"{kind}@1:7")
        assert (inj.kind, inj.rank, inj.step) == (kind, 1, 7)
        assert Injection.parse(str(inj)) == inj
    assert Injection.parse("stop@0").step == 1


def test_injector_counts_decode_steps_only():
    inj = FaultInjector((Injection("diverge_token", 1, 2), Injection("diverge_token", 0, 1)), rank=1)
    fired = []
    for has_decode in (False, True, False, True, True):
        inj.begin_step(has_decode)
        fired.append((inj.decode_step, inj.diverge_token()))
    assert fired == [(0, False), (1, False), (1, False), (2, True), (3, False)]


def test_injector_collective_skip_fires_once():
    inj = FaultInjector((Injection("hang_collective", 0, 1),), rank=0)
    inj.begin_step(True)
    assert inj.take_collective_skip() is True
    assert inj.take_collective_skip() is False
    other = FaultInjector((Injection("hang_collective", 0, 1),), rank=1)
    other.begin_step(True)
    assert other.take_collective_skip() is False


def test_injector_crash_raises_at_its_step():
    from tp_supervise.engine.inject import InjectedFault

    inj = FaultInjector((Injection("crash", 0, 2),), rank=0)
    inj.begin_step(True)
    with pytest.raises(InjectedFault, match="decode step 2"):
        inj.begin_step(True)
