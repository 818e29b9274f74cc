"""Everything tp-supervise knows about SGLang, in one place (seams checked against sglang 0.5.23's source;
only its distributed layer has run here: it has no CPU build).  See ``engines/vllm.py`` for what each name
means.  Plain data, stdlib only.
"""

from __future__ import annotations

from .seams import Seam

NAME = "sglang"
CHECKED_RELEASES = ("0.5.23", "0.5.23")  # the releases its seams were checked on (see engines/vllm.py)


def _group_coordinator() -> tuple[Seam, ...]:
    """SGLang's fork does its CPU path (shm kernel or gloo) inline in the public methods, and reaches
    ``_all_reduce_out_place``/``_all_reduce_in_place`` only through its custom ops on GPU: the public
    methods are the seams, the inner ones optional (a call inside a wrapped call is part of it)."""
    out = [
        Seam("GroupCoordinator", "all_reduce", "collective", ("input_",), label="sglang.all_reduce"),
        Seam("GroupCoordinator", "all_gather", "collective", ("input_", "dim"), label="sglang.all_gather"),
        Seam("GroupCoordinator", "broadcast", "collective", ("input_", "src"), label="sglang.broadcast"),
        Seam("GroupCoordinator", "barrier", "collective", (), label="sglang.barrier"),
    ]
    for name, label in (
        ("_all_reduce_out_place", "all_reduce"),
        ("_all_reduce_in_place", "all_reduce"),
        ("reduce_scatter", "reduce_scatter"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("reduce_scatter_along_dim", "reduce_scatter"),
        ("reduce_scatterv", "reduce_scatterv"),
        ("all_gather_into_tensor", "all_gather"),
        ("all_gatherv", "all_gatherv"),
        ("gather", "gather"),
        ("broadcast_object", "broadcast_object"),
        ("broadcast_object_list", "broadcast_object_list"),
        ("broadcast_tensor_dict", "broadcast_tensor_dict"),
        ("send_object", "send_object"),
        ("recv_object", "recv_object"),
        ("send_tensor_dict", "send_tensor_dict"),
        ("recv_tensor_dict", "recv_tensor_dict"),
        ("send", "send"),
        ("recv", "recv"),
    ):
        out.append(Seam("GroupCoordinator", name, "collective", (), required=False, label=f"sglang.{label}"))
    return tuple(out)


SEAMS: dict[str, tuple[Seam, ...]] = {
    "sglang.srt.distributed.parallel_state": _group_coordinator(),
    # its schedulers are its ranks: the batch is their step
    "sglang.srt.managers.scheduler": (
        Seam("Scheduler", "run_batch", "step", ("batch",), label="run_batch"),
        Seam("Scheduler", "recv_requests", "idle", (), required=False),  # before 0.5.2x
    ),
    # 0.5.2x moved the wait for requests to a component of the scheduler
    "sglang.srt.managers.scheduler_components.request_receiver": (
        Seam("SchedulerRequestReceiver", "recv_requests", "idle", ()),
    ),
}

# sglang::scheduler[_TP<n>...]: its schedulers (each also a rank); the detokenizer and others: helpers.
TITLE_ROLES: tuple[tuple[str, str], ...] = (
    ("sglang::scheduler", "scheduler"),  # each is also a rank: its slot says so first
    ("sglang::detokenizer", "helper"),
    ("sglang::", "helper"),
)

ROLE_WORDS: dict[str, str] = {
    "scheduler": "SGLang's scheduler",
    "frontend": "SGLang's tokenizer manager",
    "helper": "SGLang's helper process",
}

LAUNCHER_WORDS: tuple[str, ...] = ("sglang.launch_server", "sglang.srt.server", "sglang.launch_server.py")
CLI: tuple[str, ...] = ()
NO_API_FLAGS: tuple[str, ...] = ()  # its nodes > 0 serve no API either: engine_launch says so
MULTI_CONTROL_FLAGS: tuple[str, ...] = ("--dp-size", "--dp", "--data-parallel-size")
# Its model runs eagerly unless asked (--enable-torch-compile); on GPUs it captures CUDA graphs by default
# (--disable-cuda-graph), which hide the same collectives from Python.
COMPILES_BY_DEFAULT = False
EAGER_FLAGS: tuple[str, ...] = ()
COMPILE_FLAGS: tuple[str, ...] = ("--enable-torch-compile",)
DEFAULT_PORT = 30000  # its listener's default (127.0.0.1:30000)
TP_FLAGS: tuple[str, ...] = ("--tp-size", "--tp_size", "--tp", "--tensor-parallel-size", "--tensor_parallel_size")
PP_FLAGS: tuple[str, ...] = ("--pp-size", "--pp_size", "--pp", "--pipeline-parallel-size", "--pipeline_parallel_size")

DP_FLAGS: tuple[str, ...] = ()  # its data parallel (attention) runs within the TP ranks: no more ranks

# Its own multi-node launch: the same line on every node with --node-rank; node 0 hosts the torch.distributed
# rendezvous at --dist-init-addr HOST:PORT and takes 6 ports from PORT up (its ZMQ channels).  Nodes > 0 run no
# HTTP server.
NNODES_FLAGS: tuple[str, ...] = ("--nnodes",)
NODE_RANK_FLAGS: tuple[str, ...] = ("--node-rank", "--node_rank")
MASTER_ADDR_FLAGS: tuple[str, ...] = ()
MASTER_PORT_FLAGS: tuple[str, ...] = ()
DIST_INIT_FLAGS: tuple[str, ...] = ("--dist-init-addr", "--nccl-init-addr")
DEFAULT_MASTER: tuple[str, int] | None = None  # --dist-init-addr is required with --nnodes > 1
RENDEZVOUS_SPAN = 6

MODEL_FLAGS: tuple[str, ...] = ("--model-path", "--model")
JOB_FLAGS: dict[str, tuple[str, ...]] = {
    "model": MODEL_FLAGS,
    "revision": ("--revision",),
    "tokenizer": ("--tokenizer-path",),
    "tensor_parallel_size": TP_FLAGS,
    "pipeline_parallel_size": PP_FLAGS,
    "data_parallel_size": ("--dp-size", "--dp", "--data-parallel-size"),
    "expert_parallel_size": ("--ep-size", "--ep", "--expert-parallel-size"),
    "enable_dp_attention": ("--enable-dp-attention",),
    "nnodes": NNODES_FLAGS,
    "dtype": ("--dtype",),
    "quantization": ("--quantization",),
    "kv_cache_dtype": ("--kv-cache-dtype",),
    "page_size": ("--page-size",),
    "context_length": ("--context-length",),
    "max_running_requests": ("--max-running-requests",),
    "chunked_prefill_size": ("--chunked-prefill-size",),
    "disable_cuda_graph": ("--disable-cuda-graph",),
    "cuda_graph_bs": ("--cuda-graph-bs",),
    "cuda_graph_max_bs": ("--cuda-graph-max-bs",),
    "load_format": ("--load-format",),
    "random_seed": ("--random-seed",),
}
CONFIG_FLAGS: tuple[str, ...] = ("--config",)
DISTRIBUTIONS: tuple[str, ...] = ("sglang",)

# --enable-metrics; older releases and some dashboards spell the gauge the second way
METRIC_TOKENS: tuple[str, ...] = ("sglang:generation_tokens_total",)
METRIC_RUNNING: tuple[str, ...] = ("sglang:num_running_reqs", "sglang:num_requests_running")

RELAY_ADAPTER = "openai"  # no token ids asked: a half-sent stream is resent whole
