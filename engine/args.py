"""Engine command line and launch environment (torch-free: bad input exits 2 in milliseconds).

``python -m tp_supervise.engine [ENGINE ARGS]`` runs one rank.  The supervisor (``supervise
serve`` with no command) passes ENGINE ARGS through verbatim and sets the
torchrun environment (RANK, WORLD_SIZE, ...); without it the engine runs as a
single rank (TP=1).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .inject import ALL_KINDS, Injection
from .model_config import PRESETS, ModelConfig, ModelConfigError
from .runfiles import RUN_DIR_ENV
from .sharding import ShardingError, check_shardable

DEVICES = ("cpu", "cuda")
CONTROL_PLANES = ("broadcast", "replicated")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_BATCH_TOKENS = 4096
DEFAULT_MAX_CONTEXT = 2048
DEFAULT_SEED = 0
DEFAULT_MAX_WAITING = 256  # requests queued for a batch slot; more get 429 + Retry-After
DEFAULT_READ_TIMEOUT_S = 15.0  # headers and body of one request must arrive within this
DEFAULT_PRESET = "tiny"
MAX_PORT = 65535
COLLECTIVE_KINDS = ("hang_collective",)  # meaningless without peers


@dataclass(frozen=True)
class DistEnv:
    """The torchrun-style environment of this rank."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE={self.local_world_size}")

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> DistEnv:
        def num(name: str, default: int) -> int:
            text = env.get(name)
            if text is None or text == "":
                return default
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"environment variable {name}={text!r} is not an integer") from None

        world = num("WORLD_SIZE", 1)
        return cls(
            rank=num("RANK", 0),
            local_rank=num("LOCAL_RANK", 0),
            world_size=world,
            local_world_size=num("LOCAL_WORLD_SIZE", world),
            group_rank=num("GROUP_RANK", 0),
            master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            master_port=num("MASTER_PORT", 29500),
        )

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    control_plane: str = "broadcast"
    model_dir: str | None = None
    random_preset: str = DEFAULT_PRESET
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    injections: tuple[Injection, ...] = ()
    sync_token_ids: bool = False
    seed: int = DEFAULT_SEED
    max_batch: int = DEFAULT_MAX_BATCH
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_context: int = DEFAULT_MAX_CONTEXT
    dtype: str = "float32"
    threads: int | None = None
    served_model_name: str | None = None
    trace_events: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    max_prompt_tokens: int | None = None  # None: the context less one token
    run_dir: str | None = None  # $SUPERVISE_RUN_DIR: in-flight fingerprints, quarantine, incident (runfiles.py)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model_dir:
            return Path(self.model_dir).resolve().name
        return f"random-{self.random_preset}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_supervise.engine",
        description="Reference tensor-parallel Llama engine (one rank per process, torchrun environment).",
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument(
        "--control-plane",
        choices=CONTROL_PLANES,
        default="broadcast",
        help="broadcast: rank 0 schedules and sends step plans; replicated: every rank schedules",
    )
    p.add_argument(
        "--model",
        dest="model_dir",
        metavar="DIR",
        help="Hugging Face Llama directory (config.json, *.safetensors, tokenizer.json); "
        "default: a seeded random model with a byte-level tokenizer",
    )
    p.add_argument(
        "--random-preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        help="size of the random model when --model is not given",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="HTTP frontend address (rank 0 only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP frontend port; 0 picks a free one")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@RANK[:STEP]",
        help=f"fault injection, repeatable; kinds: {', '.join(ALL_KINDS)} (poison: KIND@RANK)",
    )
    p.add_argument(
        "--sync-token-ids", action="store_true", help="replicated plane: MIN all-reduce of the sampled ids every step"
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random model weights and default sampling seeds")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="sequences per step")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="prompt tokens prefilled per step (a longer single prompt still runs alone)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help=f"tokens per sequence, prompt included (default: min({DEFAULT_MAX_CONTEXT}, model limit))",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: CPUs / ranks on this node)"
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests that may wait for a batch slot; beyond it the API answers 429 with Retry-After",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a client must send a request's headers, and then its body, within this (else 408/close)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt accepted, in tokens (default: --max-context - 1)",
    )
    p.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    p.add_argument(
        "--trace-events",
        metavar="DIR",
        default=None,
        help="write every rank's consensus events to DIR/rank-<r>.jsonl (debugging)",
    )
    return p


def resolve_model(model_dir: str | None, preset: str) -> ModelConfig:
    if model_dir is None:
        return PRESETS[preset]
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"--model {model_dir}: not a directory")
    cfg = ModelConfig.from_dir(path)
    if not any(path.glob("*.safetensors")):
        raise ModelConfigError(f"--model {model_dir}: no *.safetensors files")
    if not (path / "tokenizer.json").is_file():
        raise ModelConfigError(f"--model {model_dir}: no tokenizer.json")
    return cfg


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, DistEnv, ModelConfig]:
    """Parse and validate everything that can be checked without torch; exit 2 on bad input."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    try:
        dist_env = DistEnv.from_environ(env)
    except ValueError as exc:
        parser.error(str(exc))
    injections = []
    for text in ns.inject:
        try:
            inj = Injection.parse(text)
        except ValueError as exc:
            parser.error(str(exc))
        if inj.rank >= dist_env.world_size:
            parser.error(f"--inject {text}: rank {inj.rank} does not exist (WORLD_SIZE={dist_env.world_size})")
        if inj.kind in COLLECTIVE_KINDS and dist_env.world_size == 1:
            parser.error(f"--inject {text}: {inj.kind} needs collectives, i.e. more than one rank")
        injections.append(inj)
    if not 0 <= ns.port <= MAX_PORT:
        parser.error(f"--port {ns.port}: must be in 0..{MAX_PORT}")
    for name in ("max_batch", "max_batch_tokens"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.max_waiting < 0:
        parser.error("--max-waiting must be >= 0")
    if not 0.1 <= ns.read_timeout <= 3600:  # also refuses nan
        parser.error("--read-timeout must be a number of seconds in 0.1..3600")
    if ns.threads is not None and ns.threads < 1:
        parser.error("--threads must be >= 1")
    if ns.sync_token_ids and ns.control_plane != "replicated":
        parser.error("--sync-token-ids only applies to --control-plane replicated")
    try:
        model_cfg = resolve_model(ns.model_dir, ns.random_preset)
        check_shardable(model_cfg, dist_env.world_size)
    except (ModelConfigError, ShardingError) as exc:
        parser.error(str(exc))
    max_context = ns.max_context if ns.max_context is not None else min(DEFAULT_MAX_CONTEXT, model_cfg.max_position)
    if not 2 <= max_context <= model_cfg.max_position:
        parser.error(f"--max-context {max_context}: must be in 2..{model_cfg.max_position} (max_position_embeddings)")
    if ns.max_prompt_tokens is not None and not 1 <= ns.max_prompt_tokens < max_context:
        parser.error(
            f"--max-prompt-tokens {ns.max_prompt_tokens}: must be in 1..{max_context - 1} (below --max-context)"
        )
    cfg = EngineConfig(
        device=ns.device,
        control_plane=ns.control_plane,
        model_dir=ns.model_dir,
        random_preset=ns.random_preset,
        host=ns.host,
        port=ns.port,
        injections=tuple(injections),
        sync_token_ids=ns.sync_token_ids,
        seed=ns.seed,
        max_batch=ns.max_batch,
        max_batch_tokens=ns.max_batch_tokens,
        max_context=max_context,
        dtype=ns.dtype,
        threads=ns.threads,
        served_model_name=ns.served_model_name,
        trace_events=ns.trace_events,
        max_waiting=ns.max_waiting,
        read_timeout=ns.read_timeout,
        max_prompt_tokens=ns.max_prompt_tokens,
        run_dir=env.get(RUN_DIR_ENV) or None,
    )
    return cfg, dist_env, model_cfg
