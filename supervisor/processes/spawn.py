"""Starting rank processes (spawn mode) and the launcher (tree mode).

Every rank:
* runs in a process group of its own (``setpgid`` before exec), so a group signal
  reaches its children and nothing else, and a terminal's Ctrl-C reaches the
  supervisor only (the rank's group is never the foreground one).  It stays in
  the supervisor's *session*: where the kernel groups CPU time by session
  (autogroup, ``/proc/sys/kernel/sched_autogroup_enabled``, on most
  distributions' kernels), a session of its own made the engine's processes and
  the supervisor two scheduling groups, and vLLM on a host whose cores it fills
  served 0.74x the tokens/s it served alone (the same with the supervisor's
  session shared: 1.0x; docs/benchmarks.md, "Where supervised vLLM's cost
  goes");
* reads its stdin from /dev/null (a background group reading the terminal
  would be stopped by SIGTTIN);
* gets ``PR_SET_PDEATHSIG = SIGKILL`` between fork and exec, so it dies with
  the supervisor whatever language it is written in (the signal fires when the
  *thread* that forked it exits: ranks are only ever spawned from the main
  thread, which lives as long as the supervisor);
* inherits the read end of the death pipe (``SUPERVISE_DEATH_FD``): the
  rank-side runtime exits on EOF, a second line of defence for processes that
  lose the parent-death signal (e.g. across a setuid exec);
* names the supervisor its ptracer (``PR_SET_PTRACER``), so stacks need no
  root under Yama ``ptrace_scope=1``;
* gets the torchrun environment plus ``SUPERVISE_*``; the user's environment is
  passed through untouched otherwise (the supervisor never edits os.environ);
* writes its stdout and stderr to pipes the run's output pump reads
  (``supervisor/processes/output_pump.py``: console prefixes, ``--log-dir`` files, the stderr
  tail of its ``rank_exit`` bundle); ``isatty()`` is false in the rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tp_supervise.dumps.procinfo import process_comm, process_title, send_to_group

from ..rank import runtime
from ..rank.ptrace import allow_tracer
from . import output_pump as output
from . import pidfds as procs
from .cgroup import join_in_child
from .exits import ExitInfo

# The rank package the ranks load (by file location, from its sitecustomize): a traceback whose innermost frame is in
# it is our code's (supervisor/incidents/hook_fault.py).
RANK_PACKAGE_DIR = Path(__file__).resolve().parents[1] / "rank"
HOOK_DIR = RANK_PACKAGE_DIR / "_hook"  # holds sitecustomize.py and nothing else
STACK_SIGNAL = signal.SIGRTMIN + 3
ENV_RUN_KEY = "SUPERVISE_RUN_KEY"  # the marker teardown and the sweep look for (supervisor/processes/pidfds.py)
ROLE_NAME = "default"  # torchrun's role name when none is given
FR_BUFFER_DEFAULT = "2000"


@dataclass(frozen=True)
class RunContext:
    """Per-run facts every rank's environment is built from."""

    run_id: str
    run_dir: Path
    heartbeat_path: Path
    death_fd: int
    supervisor_pid: int
    world_size: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    zero_code_hook: bool
    max_restarts: int = 0
    run_key: str = ""  # what marks this node's processes of the run (run id, plus the node rank on several nodes)
    control_path: Path | None = None  # the control segment (docs/supervisor.md, "Roles")
    cgroup_procs: str | None = (
        None  # the run's cgroup.procs: ranks join it before exec (supervisor/processes/cgroup.py)
    )


@dataclass(frozen=True)
class RankSpec:
    """One rank to start: its identity and its exact argv and environment."""

    slot: int  # local rank on this node = heartbeat slot
    rank: int  # global rank
    argv: tuple[str, ...]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...] = ()  # kept open at their numbers besides the death pipe (rank 0's listening socket)


@dataclass
class RankHandle:
    """A live (or finished) rank process.  Only the supervisor mutates it.

    ``popen`` is None for tree-mode ranks, which are grandchildren started by
    the launcher and found through their heartbeat slot.
    """

    spec: RankSpec
    pid: int
    started_at: float
    popen: subprocess.Popen | None = None
    exit: ExitInfo | None = None
    exited_at: float | None = None
    # Held from the spawn (or the tree-mode claim) until the teardown reaped it: every signal goes through it.
    proc: procs.Pidfd | None = None
    title: str = ""  # its process title as last read (an engine renames its workers: VLLM::Worker_TP0)

    comm: str = ""  # its kernel name when the title was read (setproctitle changes both)
    role: str = ""  # not a rank: what the engine adapter said it is (attempt.ROLE_*); "" not said

    def read_title(self) -> None:
        """Read the title again while the process is alive (kept once it is gone)."""
        if self.alive:
            self.comm = _comm(self.pid)
            # A title once read is not replaced by the kernel's 15-character name of a process already exiting
            # (its command line gone with its memory: VLLM::EngineCore would become VLLM::EngineCor).
            self.title = process_title(self.pid, comm_fallback=not self.title) or self.title

    def renamed(self) -> bool:
        """Its kernel name changed since the title was read (``/proc/<pid>/comm``: no lock of the process is taken,
        unlike the command line, so a rank stuck in the kernel cannot block this check)."""
        return self.alive and _comm(self.pid) not in ("", self.comm)

    @property
    def slot(self) -> int:
        return self.spec.slot

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def alive(self) -> bool:
        return self.exit is None


_comm = process_comm


def _join_path(first: str, rest: str | None) -> str:
    return first if not rest else f"{first}{os.pathsep}{rest}"


def error_file(run_dir: Path, rank: int) -> Path:
    """Where a rank's ``torch.distributed.elastic`` ``@record`` writes its structured error."""
    return Path(run_dir) / "errors" / f"rank-{rank}.json"


def rank_env(
    base: Mapping[str, str],
    ctx: RunContext,
    slot: int | None,
    extra: Mapping[str, str] | None = None,
    restart_count: int = 0,
) -> dict[str, str]:
    """The environment of one rank (``slot`` None: the tree-mode launcher)."""
    env = dict(base)
    if slot is not None:
        # torchrun's contract (torch.distributed.run); in tree mode the launcher sets these itself.
        rank = ctx.node_rank * ctx.nproc_per_node + slot
        errors = error_file(ctx.run_dir, rank)
        errors.parent.mkdir(mode=0o700, exist_ok=True)
        env.update(
            {
                "MASTER_ADDR": ctx.master_addr,
                "MASTER_PORT": str(ctx.master_port),
                "WORLD_SIZE": str(ctx.world_size),
                "LOCAL_WORLD_SIZE": str(ctx.nproc_per_node),
                "GROUP_RANK": str(ctx.node_rank),
                "GROUP_WORLD_SIZE": str(ctx.world_size // ctx.nproc_per_node),
                "ROLE_NAME": ROLE_NAME,
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(ctx.world_size),
                "RANK": str(rank),
                "LOCAL_RANK": str(slot),
                runtime.ENV_SLOT: str(slot),
                "TORCHELASTIC_RUN_ID": ctx.run_id,
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(ctx.max_restarts),
                "TORCHELASTIC_ERROR_FILE": str(errors),
            }
        )
        if ctx.nproc_per_node > 1:  # torchrun's default then: the ranks share the node's cores
            env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        {
            runtime.ENV_RUN_ID: ctx.run_id,
            ENV_RUN_KEY: ctx.run_key or ctx.run_id,
            runtime.ENV_RUN_DIR: str(ctx.run_dir),
            runtime.ENV_HEARTBEAT: str(ctx.heartbeat_path),
            runtime.ENV_DEATH_FD: f"{ctx.death_fd}:{os.fstat(ctx.death_fd).st_ino}",
            runtime.ENV_SUPERVISOR_PID: str(ctx.supervisor_pid),
            runtime.ENV_STACK_SIGNAL: str(int(STACK_SIGNAL)),
            runtime.ENV_SLOT_BASE: str(ctx.node_rank * ctx.nproc_per_node),
        }
    )
    if ctx.control_path is not None:
        env[runtime.ENV_CONTROL] = str(ctx.control_path)
    env.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER_DEFAULT)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if ctx.zero_code_hook:
        env["PYTHONPATH"] = _join_path(str(HOOK_DIR), base.get("PYTHONPATH"))
    for key, value in (extra or {}).items():
        if key in base:  # the user's explicit setting wins
            continue
        env[key] = value
    return env


def _child_setup(supervisor_pid: int, cgroup_procs: str | None):
    def setup() -> None:
        # Runs in the child after fork, before exec (Popen returns once it has: the group exists by then).
        os.setpgid(0, 0)  # a process group of its own, in the supervisor's session (module docstring)
        if cgroup_procs:
            join_in_child(cgroup_procs)
        procs.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != supervisor_pid:
            os._exit(runtime.EXIT_SUPERVISOR_GONE)  # it died between fork and prctl
        # Yama ptrace_scope=1: py-spy (the supervisor's child) may attach without root or CAP_SYS_PTRACE; the
        # relation outlives exec, so it holds for any program, Python or not (docs/supervisor.md).
        allow_tracer(supervisor_pid)

    return setup


def spawn(spec: RankSpec, ctx: RunContext, cwd: str | None = None, pump: output.RankOutput | None = None) -> RankHandle:
    """Start one rank (slot -1: the tree-mode launcher).  Must be called from the main thread (see module doc).

    Its stdout and stderr are pipes to ``pump`` (default: the run's, ``output.installed()``); with no
    pump the process inherits the supervisor's streams."""
    pump = pump or output.installed()
    source = output.Source() if spec.slot < 0 else output.Source(rank=spec.rank, local_rank=spec.slot)
    streams = pump.open(source, ctx.run_id) if pump is not None else None
    try:
        popen = subprocess.Popen(
            list(spec.argv),
            env=dict(spec.env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            pass_fds=(ctx.death_fd, *spec.pass_fds),
            preexec_fn=_child_setup(ctx.supervisor_pid, ctx.cgroup_procs),
            close_fds=True,
            stdout=streams.stdout if streams else None,
            stderr=streams.stderr if streams else None,
        )
    except BaseException:
        if streams is not None:
            streams.abandon()
        raise
    if streams is not None:
        streams.started()
    return RankHandle(spec=spec, pid=popen.pid, popen=popen, started_at=time.monotonic())


def signal_group(handle: RankHandle, signum: int) -> bool:
    """Signal a rank (or the launcher) and the process group it leads; never a pid someone else reuses.

    The process itself is signalled through its pidfd.  The group is signalled
    by number (``killpg``), which is safe only while the leader is our
    unreaped child: a zombie still holds its pid, and a pid that names a
    process (or a group or session) is never handed out again, so the group
    number cannot be reused while we hold the leader unreaped.  The exit
    monitor therefore reads a rank's status without reaping it (``WNOWAIT``)
    and only the teardown reaps, after its last group signal.  A tree-mode
    rank is not our child (or not a group leader): it gets the pidfd signal
    only; its tree is found by the teardown's scan.
    """
    proc = handle.proc
    if proc is None:
        return False
    if proc.child and not proc.reaped and proc.fd >= 0:
        return send_to_group(proc.fd, proc.pid, signum)
    return proc.send(signum)
