"""What ``supervise drill -- COMMAND`` can break, and what a perfect supervisor says about each (pure data).

A kind is one fault in one process of the run: a signal sent from outside,
a fault armed in the process through the drill's injection lane
(``rank.drill_lane``: only in a run the drill started), a cgroup limit, or a
change to the run's environment.  Each declares its expected outcome:

* ``restart``: a fatal verdict (``reason``: ``rank_exit`` exit 80, ``hang``
  81), the group torn down and started again behind the relay;
* ``runs on``: no fatal verdict; with ``reason`` ``straggler`` the slow
  process is named (a straggler bundle) and nothing is stopped;

and the culprit by role (``rank``, ``scheduler``, ``frontend``) and rank.
``score`` compares what happened with that.  docs/drills.md is the
operator's table of these.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

FAULT_RANK = 1
RESTART, RUNS_ON = "restart", "runs on"
ROLES = ("rank", "scheduler", "frontend")
EXIT_CODES = {"rank_exit": 80, "hang": 81, "peer_failed": 84}


@dataclass(frozen=True)
class Expect:
    outcome: str  # RESTART | RUNS_ON
    reason: str | None  # rank_exit | hang | straggler | None (no verdict at all) | "fatal" (either)
    role: str | None = None  # the culprit's role, None: nobody
    rank: int | None = None
    says: str = ""  # words the verdict must carry (the OOM killer, a stopped process)
    stacks: bool = True  # the bundle holds every live process's stack (not where ptrace is denied)

    def culprit(self) -> str:
        if self.role is None:
            return "nobody"
        return f"rank {self.rank}" if self.role == "rank" else self.role

    def line(self) -> str:
        if self.outcome == RUNS_ON:
            return f"runs on; {self.reason} names {self.culprit()}" if self.reason else "runs on; no verdict"
        code = EXIT_CODES.get(self.reason or "", None)
        reason = "rank_exit or hang" if self.reason == "fatal" else f"{self.reason} ({code})"
        return f"{reason}, {self.culprit()}, restart"


@dataclass(frozen=True)
class Kind:
    name: str
    family: str
    role: str  # the process it breaks
    does: str  # one line for ``--list-kinds`` and the docs
    expect: Expect
    signum: int | None = None  # a signal from outside
    lane: tuple[str, str] | None = None  # (lane kind, seam): armed in the process (rank.drill_lane)
    cpu_share: float | None = None  # a CPU quota: this share of what the process used under load
    memory: bool = False  # a memory limit the process grows into (the kernel's OOM killer)
    environment: str | None = None  # shm_full | dump_disk_full | ptrace_denied
    nodes: int = 1  # kinds that need the engine on two nodes
    tags: tuple[str, ...] = field(default_factory=tuple)


def _signals() -> list[Kind]:
    out = []
    names = {
        signal.SIGKILL: ("kill", "SIGKILL (an OOM kill, a crash without a trace)"),
        signal.SIGSEGV: ("segv", "SIGSEGV (a native crash)"),
        signal.SIGABRT: ("abort", "SIGABRT (a C++ abort: no Python handler runs)"),
        signal.SIGSTOP: ("stop", "SIGSTOP (stopped: alive, holding its peers)"),
    }
    for role, who in (
        ("rank", f"TP worker {FAULT_RANK}"),
        ("scheduler", "the engine core"),
        ("frontend", "the API server"),
    ):
        for signum, (short, what) in names.items():
            # A SIGSEGV sent with kill() is not a fault at an address: a process whose engine handles it (vLLM's
            # workers do) survives and abandons its step, which is a hang naming it; either ruling is right
            reason = {signal.SIGSTOP: "hang", signal.SIGSEGV: "fatal"}.get(signum, "rank_exit")
            out.append(
                Kind(
                    f"{short}_{role}",
                    "signal",
                    role,
                    f"{what} to {who}",
                    Expect(RESTART, reason, role, FAULT_RANK if role == "rank" else None),
                    signum=signum,
                )
            )
    return out


def _rank(name: str, family: str, does: str, lane: tuple[str, str], reason: str = "hang", says: str = "") -> Kind:
    return Kind(name, family, "rank", does, Expect(RESTART, reason, "rank", FAULT_RANK, says), lane=lane)


KINDS: tuple[Kind, ...] = (
    *_signals(),
    _rank("stuck_python", "stuck", "TP worker 1 spins in Python inside its step", ("python_loop", "step")),
    _rank(
        "stuck_native_gil",
        "stuck",
        "TP worker 1 blocks inside its step in a native call that holds the GIL (py-spy must still read it)",
        ("native_gil", "step"),
    ),
    _rank(
        "stuck_native_nogil",
        "stuck",
        "TP worker 1 blocks inside its step in a native call that releases the GIL",
        ("native_nogil", "step"),
    ),
    _rank("deadlock", "stuck", "two threads of TP worker 1 take two locks in opposite orders", ("deadlock", "step")),
    _rank(
        "skip_collective",
        "collective",
        "TP worker 1 skips one all-reduce and goes on (its peer waits in it)",
        ("skip_collective", "collective"),
    ),
    _rank(
        "misshaped_collective",
        "collective",
        "TP worker 1 calls an all-reduce with one element fewer than its peer",
        ("misshaped_collective", "collective"),
        reason="fatal",
    ),
    _rank(
        "exception",
        "exit",
        "TP worker 1 raises an exception inside its step",
        ("raise", "step"),
        reason="fatal",
    ),
    _rank(
        "exit0",
        "exit",
        "TP worker 1 calls os._exit(0) in the middle of a step (an early exit that looks clean)",
        ("exit0", "step"),
        reason="rank_exit",
    ),
    Kind(
        "oom",
        "memory",
        "rank",
        "TP worker 1 grows inside a memory cgroup limit the drill sets until the kernel's OOM killer takes it",
        Expect(RESTART, "rank_exit", "rank", FAULT_RANK, says="OOM"),
        lane=("grow_memory", "now"),
        memory=True,
    ),
    *(
        Kind(
            f"slow_{pct}",
            "straggler",
            "rank",
            f"TP worker 1 held by a CPU quota to {pct} % of the CPU it used under load: a straggler, not a hang",
            Expect(RUNS_ON, "straggler", "rank", FAULT_RANK),
            cpu_share=pct / 100,
        )
        for pct in (90, 50, 15)
    ),
    Kind(
        "stuck_scheduler",
        "control",
        "scheduler",
        "the engine core spins in Python inside its scheduling call",
        Expect(RESTART, "hang", "scheduler"),
        lane=("python_loop", "schedule"),
    ),
    Kind(
        "shm_full",
        "environment",
        "rank",
        "/dev/shm filled to the last byte while the engine serves (its segments are already made)",
        Expect(RUNS_ON, None),
        environment="shm_full",
    ),
    Kind(
        "dump_disk_full",
        "environment",
        "rank",
        "the dump directory's disk is full when TP worker 1 is SIGKILLed: the verdict and the restart go on",
        Expect(RESTART, "rank_exit", "rank", FAULT_RANK),
        signum=signal.SIGKILL,
        environment="dump_disk_full",
    ),
    Kind(
        "ptrace_denied",
        "environment",
        "rank",
        "the supervisor may not ptrace (no CAP_SYS_PTRACE, TP worker 1 not dumpable) when TP worker 1 stops",
        Expect(RESTART, "hang", "rank", FAULT_RANK, stacks=False),
        signum=signal.SIGSTOP,
        environment="ptrace_denied",
    ),
    Kind(
        "node_supervisor_killed",
        "multinode",
        "node",
        "node 1's supervisor SIGKILLed (two nodes)",
        Expect(RESTART, "peer_failed", None),
        nodes=2,
    ),
    Kind(
        "partition",
        "multinode",
        "node",
        "the link between the two nodes dropped (two nodes)",
        Expect(RESTART, "peer_failed", None),
        nodes=2,
    ),
    Kind(
        "stop_follower_rank",
        "multinode",
        "rank",
        "SIGSTOP to the TP worker on node 1 (two nodes)",
        Expect(RESTART, "hang", "rank", FAULT_RANK),
        signum=signal.SIGSTOP,
        nodes=2,
    ),
)
BY_NAME = {k.name: k for k in KINDS}
FAMILIES = tuple(dict.fromkeys(k.family for k in KINDS))


class KindError(ValueError):
    """The drill's --kinds / --roles name nothing it has."""


def select(kinds: str | None, roles: str | None, nodes: int = 1) -> list[Kind]:
    """The kinds to run: ``kinds`` (names, families, ``all``; default all), only those of ``roles`` (default all),
    those that need more nodes than the run has are kept (reported as not run, never dropped silently)."""
    words = ["all"] if kinds in (None, "", "all") else [w.strip() for w in (kinds or "").split(",") if w.strip()]
    chosen: list[Kind] = []
    for word in words:
        if word == "all":
            found = list(KINDS)
        elif word in BY_NAME:
            found = [BY_NAME[word]]
        elif word in FAMILIES:
            found = [k for k in KINDS if k.family == word]
        else:
            raise KindError(
                f"unknown kind {word!r}: choose kind names or families ({', '.join(FAMILIES)}); "
                "`supervise drill --list-kinds` lists them"
            )
        chosen += [k for k in found if k not in chosen]
    if roles:
        wanted = [r.strip() for r in roles.split(",") if r.strip()]
        bad = [r for r in wanted if r not in (*ROLES, "node")]
        if bad:
            raise KindError(f"unknown role(s) {', '.join(bad)}: choose from {', '.join((*ROLES, 'node'))}")
        chosen = [k for k in chosen if k.role in wanted]
    if not chosen:
        raise KindError("no kind left to run: --kinds and --roles select nothing together")
    return chosen


@dataclass
class Observed:
    """What one trial of a kind produced (filled by the drill's runner)."""

    reason: str | None = None  # the fatal verdict's reason (the first after the fault), or straggler
    culprit_role: str | None = None
    culprit_rank: int | None = None
    verdict: str = ""
    # restart kinds: the group was started again and a request was served after the fault; runs-on kinds: the run
    # stayed up through the watch
    restarted: bool = False
    verdict_s: float | None = None  # fault → ruling
    serving_again_s: float | None = None
    engine_start_s: float | None = None  # the trial's first start: supervise serve → the relay's /readyz 200
    client_errors: int = 0
    streams_cut: int = 0
    leftovers: list[str] = field(default_factory=list)
    stacks_missing: list[str] = field(default_factory=list)
    problem: str = ""  # the drill could not do its part (no such process, the lane refused)
    setup: str = ""  # what the drill set around the process (a quota, a limit, a full filesystem)


def score(kind: Kind, seen: Observed) -> tuple[bool, bool, str]:
    """(localised, passed, why not): localised: the culprit named is the process the kind broke (or nobody, for
    a kind with none); passed: localised, the outcome and reason as expected, clients unharmed, nothing left."""
    want = kind.expect
    if seen.problem:
        return False, False, seen.problem
    if want.role is None:
        localised = seen.culprit_role is None and (want.reason is not None or seen.reason is None)
    else:
        localised = seen.culprit_role == want.role and (want.role != "rank" or seen.culprit_rank == want.rank)
    reason_ok = (seen.reason in ("rank_exit", "hang") if want.reason == "fatal" else seen.reason == want.reason) or (
        want.reason is None and seen.reason is None
    )
    why = []
    if not reason_ok:
        why.append(f"ruled {seen.reason or 'nothing'}, expected {want.reason or 'no verdict'}")
    if not localised:
        got = (
            "nobody"
            if seen.culprit_role is None
            else (f"rank {seen.culprit_rank}" if seen.culprit_role == "rank" else seen.culprit_role)
        )
        why.append(f"named {got}, expected {want.culprit()}")
    if want.says and want.says.lower() not in seen.verdict.lower():
        why.append(f"the verdict does not say {want.says!r}")
    if want.stacks and seen.stacks_missing:
        why.append(f"the bundle has no stack of {', '.join(seen.stacks_missing[:3])}")
    if want.outcome == RUNS_ON and not seen.restarted:
        why.append("the run did not stay up")
    if want.outcome == RESTART and not seen.restarted:
        why.append("no request was served after the fault")
    if seen.client_errors or seen.streams_cut:
        why.append(f"{seen.client_errors} client error(s), {seen.streams_cut} stream(s) cut")
    if seen.leftovers:
        why.append(f"left behind: {', '.join(seen.leftovers[:3])}")
    return localised, not why, "; ".join(why)


__all__ = ["KINDS", "BY_NAME", "FAMILIES", "Expect", "Kind", "KindError", "Observed", "score", "select"]
