"""Verdict over captured evidence: which rank is somewhere else, and why (pure).

Failure taxonomy, in the order causes are looked for (the first that
applies is the root cause; the rest of the group are its consequences):

``dead``                    a rank exited (or is a zombie) while its peers run;
                            with several, the first to die (``exit["at"]``) leads
``stopped``                 state T: a stop signal (SIGSTOP …) froze it
``uninterruptible_io``      state D: blocked in the kernel (disk, NFS, driver)
``non_communication_hang``  outside any collective while peers wait inside one
                            (or, with no rank in a collective, the minority stack)
``slow``                    like the above, but it still made progress since the
                            previous sample: it is late, not stuck
``communication_hang``      every rank is inside a collective, but not the same
                            one: another op, size or dtype, or one that some
                            ranks never entered (flight recorder); with all ranks
                            in the same collective, no rank is named
``control_plane``           every live rank is idle (waiting for its next step,
                            outside steps and collectives) while a process of
                            the engine that is not a rank holds the group: its
                            scheduler (vLLM's engine core) stopped, blocked in
                            the kernel or stuck inside its step, or its front
                            end stopped or holding requests it never passes on;
                            the culprit is that process (``culprit``: role,
                            pid, title), ``culprit_ranks`` is empty
``unknown``                 nothing distinguishes any rank

"In a collective" combines three sources: the heartbeat slot (instrumented
or zero-code ranks), the flight recorder's in-flight entry, and the stack
(a torch.distributed collective frame).  Stack grouping follows ByteRobust:
ranks with the same normalised signature form a group; when one group is a
strict majority the others are suspects.

Pure: the inputs are plain data (``dumps.evidence``, ``dumps.stacks``,
``dumps.fr_analysis``, heartbeat snapshots) and this module imports none of
the capture side (py-spy, ``/proc``, signals, sockets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tp_supervise.supervisor.rank.collectives import COLLECTIVES
from tp_supervise.supervisor.rank.heartbeat import SlotSnapshot

from . import stacks as st
from .evidence import STATE_NAMES, Evidence, RankEvidence
from .fr_analysis import FrFindings

KLASSES = (
    "dead",
    "stopped",
    "uninterruptible_io",
    "communication_hang",
    "non_communication_hang",
    "slow",
    "control_plane",
    "unknown",
)
# Library frames that say *how* a rank waits, not *where*: skipped when naming its place.
WAIT_FUNCTIONS = frozenset({"wait", "sleep", "select", "poll", "acquire", "_wait_for_tstate_lock", "join"})
_COLLECTIVE_NAMES = frozenset(COLLECTIVES)
ON_DEMAND = "on_demand"
# The reasons whose group stopped making progress: only there may the control plane be what holds it (a
# scheduler inside its step is the normal state of a healthy engine at any other instant).
HANG_REASONS = frozenset({"hang", "hang_suspected"})
_DIST_PATH = ("torch/distributed/", "torch\\distributed\\")
REQUEST_PHASE = "request"  # the engine adapter's phase of a scheduler handling a client's request


@dataclass(frozen=True)
class DiagnosisPolicy:
    """Thresholds of the verdict (documented defaults, not magic numbers)."""

    busy_cpu_fraction: float = 0.5  # at or above: the rank is computing, not blocked


DEFAULT_POLICY = DiagnosisPolicy()


@dataclass(frozen=True)
class StackGroup:
    label: str  # "A" is the largest group
    signature: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Diagnosis:
    klass: str
    culprit_ranks: list[int]
    verdict: str
    ranks: dict[int, dict]  # per-rank summary.json entries
    groups: tuple[StackGroup, ...] = ()
    notes: tuple[str, ...] = ()  # supporting facts, root cause first
    # Who is somewhere else, whatever its role: {"role", "pid", "title", "rank"} (None when nobody is named).
    culprit: dict | None = None
    processes: dict[int, dict] = field(default_factory=dict)  # pid -> the processes of the run that are not ranks

    def summary_fields(self) -> dict:
        """The parts of summary.json this verdict owns."""
        return {
            "class": self.klass,
            "culprit_ranks": list(self.culprit_ranks),
            "culprit": self.culprit,
            "verdict": self.verdict,
            "ranks": {str(r): d for r, d in sorted(self.ranks.items())},
            "processes": {str(pid): d for pid, d in sorted(self.processes.items())},
            "stack_groups": [
                {
                    "label": g.label,
                    "ranks": list(g.ranks),
                    "signature": g.signature,
                    "short": st.short_signature(g.signature),
                }
                for g in self.groups
            ],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class _Place:
    """Where one rank is, from every source at hand."""

    rank: int
    ev: RankEvidence
    hb: SlotSnapshot | None
    exit: dict | None
    dead: bool
    state: str | None
    in_collective: bool
    collective: str  # "all_reduce #4 [64x256 float32]" or ""
    coll_key: tuple[str | int, ...]  # (op, seq, desc), or (op,) from a stack, for comparing ranks
    where: str  # "stuck_in_user_code (fake_rank.py)" or ""
    signature: str
    progressed: bool | None
    cpu: float | None


def _rank_list(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _verb(ranks: Sequence[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _stack_collective(threads: Sequence[st.ThreadStack]) -> str:
    main = st.main_thread(threads)
    for t in [main] if main is not None else threads:
        for f in t.python_frames:
            if f.base_function in _COLLECTIVE_NAMES and any(p in f.filename for p in _DIST_PATH):
                return f.base_function
    return ""


def _place(ev: RankEvidence, hb: SlotSnapshot | None, exit_info: dict | None, fr: FrFindings | None) -> _Place:
    state = ev.state
    dead = (not ev.alive) or state in ("Z", "X")
    if hb is not None and not hb.claimed:
        hb = None
    in_coll, collective = False, ""
    key: tuple[str | int, ...] = ()
    if hb is not None and hb.in_collective:
        in_coll = True
        desc = f" [{hb.coll_desc}]" if hb.coll_desc else ""
        collective = f"{hb.coll_op} #{hb.coll_seq}{desc}"
        key = (hb.coll_op, hb.coll_seq, hb.coll_desc)
    elif fr is not None and ev.rank in fr.in_flight:
        e = fr.in_flight[ev.rank]
        in_coll = True
        collective = f"{e.op} #{e.seq} [{e.desc}] (pg {e.pg})"
        key = (e.op, e.seq, e.desc)
    else:
        op = _stack_collective(ev.threads)
        if op:
            in_coll, collective, key = True, op, (op,)
    where = st.where(ev.threads, skip=WAIT_FUNCTIONS)
    progressed = None
    if hb is not None and ev.prev_progress is not None:
        progressed = (hb.step, hb.coll_seq) > tuple(ev.prev_progress)
    return _Place(
        rank=ev.rank,
        ev=ev,
        hb=hb,
        exit=exit_info,
        dead=dead,
        state=state if ev.alive else None,
        in_collective=in_coll and not dead,
        collective=collective,
        coll_key=key,
        where=where,
        signature=st.stack_signature(ev.threads),
        progressed=progressed,
        cpu=ev.cpu_fraction,
    )


def _groups(places: Sequence[_Place]) -> tuple[StackGroup, ...]:
    by_sig: dict[str, list[int]] = {}
    for p in places:
        if p.signature:
            by_sig.setdefault(p.signature, []).append(p.rank)
    ordered = sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    labels = [chr(ord("A") + i) if i < 26 else f"G{i}" for i in range(len(ordered))]
    return tuple(StackGroup(label, sig, tuple(sorted(r))) for label, (sig, r) in zip(labels, ordered, strict=True))


def _minority(groups: Sequence[StackGroup]) -> list[int]:
    """Ranks outside a strict-majority stack group (empty without one)."""
    if len(groups) < 2 or len(groups[0].ranks) == len(groups[1].ranks):
        return []
    return sorted(r for g in groups[1:] for r in g.ranks)


def _at_step(p: _Place) -> str:
    """Progress of a rank: steps when it reports them, else collectives entered."""
    if p.hb is None:
        return ""
    if p.hb.instrumented:
        return f" at step {p.hb.step}"
    return f" after {p.hb.coll_seq} collectives"


def _in_where(p: _Place) -> str:
    return f" in {p.where}" if p.where else ""


def _activity(p: _Place, policy: DiagnosisPolicy) -> str:
    if p.cpu is None:
        return STATE_NAMES.get(p.state or "", "")
    busy = "running" if p.cpu >= policy.busy_cpu_fraction else STATE_NAMES.get(p.state or "", "idle")
    return f"{busy}, {p.cpu * 100:.0f}% CPU"


def _peers_text(peers: Sequence[_Place]) -> str:
    """What the other ranks do: the consequence half of the verdict."""
    if not peers:
        return ""
    waiting = [p for p in peers if p.in_collective]
    parts = []
    by_coll: dict[str, list[int]] = {}
    for p in waiting:
        by_coll.setdefault(p.collective, []).append(p.rank)
    for coll, ranks in sorted(by_coll.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))):
        parts.append(f"{_rank_list(ranks)} {_verb(ranks, 'waits', 'wait')} in {coll}")
    rest = [p for p in peers if not p.in_collective]
    by_where: dict[str, list[int]] = {}
    for p in rest:
        label = "exited" if p.dead else (f"in {p.where}" if p.where else "outside collectives")
        by_where.setdefault(label, []).append(p.rank)
    for label, ranks in sorted(by_where.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))):
        parts.append(f"{_rank_list(ranks)} {_verb(ranks, 'is', 'are')} {label}")
    return "; ".join(parts)


def _join(cause: str, peers: Sequence[_Place]) -> str:
    consequence = _peers_text(peers)
    return f"{cause}; {consequence}" if consequence else cause


def _first_dead(dead: Sequence[_Place]) -> list[_Place]:
    def at(p: _Place) -> float:
        value = (p.exit or {}).get("at")
        return float(value) if isinstance(value, (int, float)) else float("inf")

    return sorted(dead, key=lambda p: (at(p), p.rank))


def _exit_text(p: _Place) -> str:
    info = p.exit or {}
    if info.get("description"):
        return str(info["description"])
    if info.get("signal"):
        core = ", core dumped" if info.get("core_dumped") else ""
        return f"killed by {info['signal']}{core}"
    if info.get("code") is not None:
        return f"exit code {info['code']}"
    if p.state == "Z":
        return "exited, not reaped: zombie"
    return "exited"


def _fr_notes(fr: FrFindings | None) -> list[str]:
    notes: list[str] = []
    if fr is None:
        return notes
    for m in fr.missing[:1]:
        notes.append(
            f"flight recorder: {_rank_list(m.missing)} never entered {m.op} seq {m.seq} [{m.desc}] "
            f"(pg {m.pg}) that {_rank_list(m.entered)} entered"
        )
    for mm in fr.mismatches[:1]:
        detail = "; ".join(f"rank {r}: {d}" for r, d in mm.by_rank.items())
        notes.append(f"flight recorder: {'/'.join(mm.kinds)} mismatch at seq {mm.seq} (pg {mm.pg}): {detail}")
    return notes


def _decide(places: list[_Place], groups, fr: FrFindings | None, policy: DiagnosisPolicy, reason: str):
    """(klass, culprits, verdict, notes)."""
    notes = _fr_notes(fr)
    alive = [p for p in places if not p.dead]

    def others(culprits: Sequence[int]) -> list[_Place]:
        return [p for p in places if p.rank not in culprits]

    dead = _first_dead([p for p in places if p.dead])
    if dead:
        first = dead[0]
        culprits = [p.rank for p in dead]
        cause = f"rank {first.rank} died ({_exit_text(first)}){_at_step(first)}"
        if len(dead) > 1:
            cause += f", then {_rank_list([p.rank for p in dead[1:]])} exited"
        return "dead", culprits, _join(cause, others(culprits)), notes

    for letter, klass, text in (
        ("T", "stopped", "is stopped (state T, a stop signal such as SIGSTOP; SIGCONT resumes it)"),
        ("t", "stopped", "is held by a tracer (state t, e.g. a debugger attached)"),
        ("D", "uninterruptible_io", "is blocked in uninterruptible I/O (state D{wchan})"),
    ):
        hit = [p for p in alive if p.state == letter]
        if hit:
            culprits = [p.rank for p in hit]
            wchan = hit[0].ev.proc.wchan if hit[0].ev.proc else ""
            what = text.format(wchan=f", in {wchan}" if wchan else "")
            if len(hit) > 1:
                what = what.replace("is ", "are ", 1)
            cause = f"{_rank_list(culprits)} {what}{_in_where(hit[0])}{_at_step(hit[0])}"
            return klass, culprits, _join(cause, others(culprits)), notes

    if reason == ON_DEMAND and alive and all(p.progressed for p in alive):
        return "unknown", [], f"all {len(alive)} live ranks are progressing", notes

    waiting = [p for p in alive if p.in_collective]
    outside = [p for p in alive if not p.in_collective]
    if waiting and outside:
        culprits = [p.rank for p in outside]
        return _outside_verdict(outside, culprits, others(culprits), policy, notes)

    if waiting:  # every live rank is inside a collective
        keys: dict[tuple[str | int, ...], list[int]] = {}
        for p in waiting:
            keys.setdefault(p.coll_key, []).append(p.rank)
        culprits = []
        if fr is not None and fr.culprit_ranks:
            culprits = sorted(fr.culprit_ranks)
        elif len(keys) > 1:
            sizes = sorted((len(v) for v in keys.values()), reverse=True)
            if sizes[0] > sizes[1]:
                biggest = max(keys.values(), key=len)
                culprits = sorted(p.rank for p in waiting if p.rank not in biggest)
            else:
                culprits = _minority(groups)
        if culprits:
            hit = [p for p in places if p.rank in culprits]
            if len(hit) == 1:
                cause = f"rank {hit[0].rank} waits in a different collective: {hit[0].collective or 'unknown'}"
            else:
                where = "; ".join(f"rank {p.rank}: {p.collective or 'unknown'}" for p in hit)
                cause = f"{_rank_list(culprits)} wait in different collectives ({where})"
            if fr is not None and fr.missing and set(fr.missing[0].missing) == set(culprits):
                m = fr.missing[0]
                cause = (
                    f"{_rank_list(culprits)} never entered {m.op} seq {m.seq} [{m.desc}] "
                    f"(pg {m.pg}) and {_verb(culprits, 'waits', 'wait')} in "
                    + ", ".join(p.collective or "another collective" for p in hit)
                )
            return "communication_hang", culprits, _join(cause, others(culprits)), notes
        if len(keys) > 1:
            return "communication_hang", [], "ranks disagree on the collective: " + _peers_text(waiting), notes
        cause = (
            f"all {len(waiting)} live ranks wait in {waiting[0].collective} and none is elsewhere: "
            "suspect the transport (network, NCCL/gloo) or a rank on another node"
        )
        return "communication_hang", [], cause, notes

    minority = _minority(groups)
    if fr is not None and fr.culprit_ranks:
        minority = sorted(fr.culprit_ranks)
    if minority:
        hit = [p for p in alive if p.rank in minority]
        return _outside_verdict(hit, minority, others(minority), policy, notes)
    if not alive:
        return "unknown", [], "no live rank to examine", notes
    same = len(groups) == 1 and len(groups[0].ranks) == len(alive)
    place = _in_where(alive[0]) if same else ""
    ats = {_at_step(p) for p in alive}
    at = ats.pop() if len(ats) == 1 else ""
    return "unknown", [], f"no rank stands out: all {len(alive)} live ranks are{place}{at}", notes


@dataclass(frozen=True)
class _Process:
    """A process of the run that is not a rank (an engine's scheduler, front end, launcher), as captured."""

    ev: RankEvidence
    where: str
    signature: str

    @property
    def role(self) -> str:
        return self.ev.role or "process"

    @property
    def alive(self) -> bool:
        return self.ev.alive and self.ev.state not in ("Z", "X")

    def who(self) -> str:
        """``vLLM's engine core (pid 12, VLLM::EngineCore)``; ``the scheduler (pid 12)`` when the engine is not
        known (its words) and the title is a command line, not a name."""
        title = self.ev.title
        named = title and not any(c.isspace() or c == "/" for c in title)
        words = self.ev.words or "the " + {"frontend": "front end"}.get(self.role, self.role)
        return f"{words} (pid {self.ev.pid}, {title})" if named else f"{words} (pid {self.ev.pid})"

    def culprit(self) -> dict:
        return {"role": self.role, "pid": self.ev.pid, "title": self.ev.title, "rank": None}


def _process(ev: RankEvidence) -> _Process:
    where = st.where(ev.threads, skip=WAIT_FUNCTIONS)
    return _Process(ev, where, st.stack_signature(ev.threads))


def _idle(p: _Place) -> bool:
    """Waiting for its next step: alive, outside any step and collective."""
    return not p.dead and not p.in_collective and not (p.hb is not None and (p.hb.in_step or p.hb.torn))


def _control_plane(places: Sequence[_Place], procs: Sequence[_Process], policy: DiagnosisPolicy, now: float):
    """(culprit process, cause) when a process that is not a rank holds the group, else None.

    Asked once no rank is dead or stopped: every live rank idle (its slot outside steps and collectives,
    its stack in no collective) and a scheduler or front end stopped, blocked in the kernel, or inside its
    step (the scheduler) or holding requests with no output (the front end) while its peers wait."""
    alive = [p for p in places if not p.dead]
    if not alive or not all(_idle(p) for p in alive):
        return None
    candidates = [q for q in procs if q.alive and q.role in ("scheduler", "frontend")]
    candidates.sort(key=lambda q: q.role != "scheduler")  # the scheduler decides every step: asked first
    for letter, text in (
        ("T", "is stopped (state T, a stop signal such as SIGSTOP; SIGCONT resumes it)"),
        ("t", "is held by a tracer (state t, e.g. a debugger attached)"),
        ("D", "is blocked in uninterruptible I/O (state D{wchan})"),
    ):
        for q in candidates:
            if q.ev.state == letter:
                wchan = q.ev.proc.wchan if q.ev.proc else ""
                where = f" in {q.where}" if q.where else ""
                return q, f"{q.who()} {text.format(wchan=f', in {wchan}' if wchan else '')}{where}"
    for q in candidates:
        hb = q.ev.heartbeat
        if hb is None:
            continue
        if q.role == "scheduler" and not hb.in_step and hb.phase == REQUEST_PHASE:
            # between steps, not waiting for requests but handling one (a utility call) while the group waits
            where = f" in {q.where}" if q.where else ""
            return q, f"{q.who()} is stuck between steps handling a client's request{where}"
        if not (hb.in_step or hb.torn):
            continue
        waited = max(0.0, now - hb.ts_step_begin) if hb.ts_step_begin else 0.0
        for_s = f" for {waited:.1f} s" if waited else ""
        where = f" in {q.where}" if q.where else ""
        cpu = q.ev.cpu_fraction
        act = ""
        if cpu is not None:
            act = f" ({'running' if cpu >= policy.busy_cpu_fraction else 'waiting'}, {cpu * 100:.0f}% CPU)"
        if q.role == "scheduler":
            phase = f", phase {hb.phase}" if hb.phase else ""
            return q, f"{q.who()} is stuck inside its step{for_s}{where}{act}{phase}"
        return q, f"{q.who()} holds requests in flight with no output{for_s}{where}{act}"
    return None


def _waiting_for(proc: _Process, places: Sequence[_Place]) -> str:
    ranks = [p.rank for p in places if not p.dead]
    if not ranks:
        return ""
    words = "its next step" if proc.role == "scheduler" else "the next step"
    return f"{_rank_list(ranks)} {_verb(ranks, 'is', 'are')} idle, waiting for {words}"


def _process_dict(q: _Process, culprit: _Process | None) -> dict:
    ev, hb = q.ev, q.ev.heartbeat
    return {
        "role": q.role,
        "who": q.who(),
        "pid": ev.pid,
        "title": ev.title,
        "alive": q.alive,
        "state": ev.state if ev.alive else None,
        "state_name": STATE_NAMES.get(ev.state or "", "") if ev.alive else "",
        "wchan": ev.proc.wchan if ev.proc else "",
        "threads": ev.proc.num_threads if ev.proc else None,
        "cpu_percent": round(ev.cpu_fraction * 100, 1) if ev.cpu_fraction is not None else None,
        "exit": ev.exit,
        "in_step": bool(hb.in_step) if hb is not None else None,
        "steps": hb.step if hb is not None else None,
        "phase": hb.phase if hb is not None else "",
        "step_tokens": hb.step_tokens if hb is not None else None,
        "where": q.where,
        "stack_signature": q.signature,
        "stack_method": ev.method,
        "stack_error": ev.error,
        "culprit": culprit is q,
    }


def _outside_verdict(hit, culprits, peers, policy, notes):
    slow = all(p.progressed for p in hit)
    klass = "slow" if slow else "non_communication_hang"
    first = hit[0]
    where = _in_where(first) if len({p.where for p in hit}) == 1 else ""
    activity = _activity(first, policy) if len(hit) == 1 else ""
    act = f" ({activity})" if activity else ""
    state = "slow: still progressing" if slow else "stuck outside collectives"
    cause = f"{_rank_list(culprits)} {_verb(culprits, 'is', 'are')} {state}{where}{act}"
    at = _at_step(first) if len(hit) == 1 else ""
    return klass, sorted(culprits), _join(cause + at, peers), notes


def _rank_dict(p: _Place, group_of: Mapping[int, str], culprits: Sequence[int], started_at: float) -> dict:
    ev, hb = p.ev, p.hb
    proc = ev.proc
    return {
        "pid": ev.pid,
        "title": ev.title,
        "slot": ev.slot,
        "alive": not p.dead,
        "state": ev.state if ev.alive else None,
        "state_name": STATE_NAMES.get(ev.state or "", "") if ev.alive else "",
        "wchan": proc.wchan if proc else "",
        "threads": proc.num_threads if proc else None,
        "cpu_percent": round(p.cpu * 100, 1) if p.cpu is not None else None,
        "exit": p.exit,
        "step": hb.step if hb else None,
        "collective_seq": hb.coll_seq if hb else None,
        "in_collective": p.in_collective,
        "collective": p.collective,
        "phase": hb.phase if hb else "",
        "heartbeat_age_s": round(started_at - hb.ts_heartbeat, 3) if hb and hb.ts_heartbeat else None,
        "where": p.where,
        "stack_signature": p.signature,
        "stack_group": group_of.get(p.rank),
        "stack_method": ev.method,
        "stack_error": ev.error,
        "culprit": p.rank in culprits,
    }


def diagnose(
    evidence: Evidence,
    *,
    reason: str,
    heartbeats: Mapping[int, SlotSnapshot] | None = None,
    fr_findings: FrFindings | None = None,
    exits: Mapping[int, dict] | None = None,
    policy: DiagnosisPolicy = DEFAULT_POLICY,
) -> Diagnosis:
    """Name the culprit ranks, the class and one actionable sentence.

    ``heartbeats`` and ``exits`` override what ``evidence`` carries per rank
    (the supervisor may hold fresher ones); ``exits[r]["at"]`` (monotonic
    time of death), when given, orders several deaths.
    """
    places = []
    procs = []
    for rank, ev in sorted(evidence.ranks.items()):
        if rank < 0:  # a process of the run that is not a rank (its scheduler, front end, launcher)
            procs.append(_process(ev))
            continue
        hb = (heartbeats or {}).get(rank, ev.heartbeat)
        ex = (exits or {}).get(rank, ev.exit)
        places.append(_place(ev, hb, ex, fr_findings))
    groups = _groups([p for p in places if not p.dead])
    held = None
    if reason in HANG_REASONS and not any(p.dead or p.state in ("T", "t", "D") for p in places):
        held = _control_plane(places, procs, policy, evidence.started_at)
    culprit_proc: _Process | None = None
    if held is not None:
        culprit_proc, cause = held
        waiting = _waiting_for(culprit_proc, places)
        klass, culprits, verdict, notes = "control_plane", [], f"{cause}; {waiting}" if waiting else cause, []
    else:
        klass, culprits, verdict, notes = _decide(places, groups, fr_findings, policy, reason)
    if reason == ON_DEMAND:
        verdict = f"on-demand snapshot: {verdict}"
    group_of = {r: g.label for g in groups for r in g.ranks}
    ranks = {p.rank: _rank_dict(p, group_of, culprits, evidence.started_at) for p in places}
    culprit = None
    if culprit_proc is not None:
        culprit = culprit_proc.culprit()
    elif len(culprits) == 1:
        only = next(p for p in places if p.rank == culprits[0])
        culprit = {"role": "rank", "pid": only.ev.pid, "title": only.ev.title, "rank": only.rank}
    return Diagnosis(
        klass=klass,
        culprit_ranks=sorted(culprits),
        verdict=verdict,
        ranks=ranks,
        groups=groups,
        notes=tuple(notes),
        culprit=culprit,
        processes={q.ev.pid or 0: _process_dict(q, culprit_proc) for q in procs},
    )
