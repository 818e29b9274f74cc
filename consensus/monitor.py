"""Supervisor side: read every rank's digest ring, compare, return verdicts.

The supervisor calls ``poll(now)`` from its "consensus" thread every few
milliseconds and decides what to do with the verdicts (observe: bundle +
metric; enforce: also teardown and exit 82).  ``poll`` never blocks: it reads
shared mappings only (supervisor/rank/ring.py), a bounded number of entries per ring
per call, so a hung, busy, stopped or dead rank cannot stall it and its event
logs stay readable.

Two comparisons run on every poll:

* published steps: per-step digests across the group (compare.StepTable);
* the step in progress: the events recorded so far by ranks in the same
  unfinished step (compare.OpenStepComparer), so a divergence whose next
  collective hangs or aborts is caught although that step never ends.

When a rank exits or the group is declared hung, call ``settle(now)`` first:
it reads the rings (a dead rank's ring is still there) and judges every
mismatch at once, so a divergence that caused the exit or hang is reported as
the first cause.

Rings appear when ranks start recording; a missing ring is looked for on
every poll, a present one is checked for replacement (a restarted rank
renames a fresh ring over its old one) every ``rescan_interval_s``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from tp_supervise.supervisor.rank import encoding
from tp_supervise.supervisor.rank.channel import ring_path
from tp_supervise.supervisor.rank.ring import NO_STEP, RingEntry, RingLayoutError, RingReader

from .compare import Decision, OpenDecision, OpenStepComparer, Outcome, StepTable
from .verdict import DivergenceVerdict, build_verdict

log = structlog.get_logger()


@dataclass(frozen=True)
class MonitorConfig:
    """Tuning of the comparison; the defaults suit every TP size we run."""

    mismatch_wait_s: float = 1.0  # wait this long for late ranks before judging a mismatch without them
    max_pending_steps: int = 256  # steps awaiting a late rank before they are dropped unconfirmed
    max_entries_per_poll: int = 256  # per ring; bounds the work of one poll
    rescan_interval_s: float = 0.2  # check present rings for replacement this often
    log_lines_kept: int = 2000  # events per rank kept in a verdict (bundle size bound)

    def __post_init__(self) -> None:
        if self.mismatch_wait_s < 0 or self.rescan_interval_s < 0:
            raise ValueError("consensus monitor intervals must be >= 0")
        if self.max_pending_steps < 1 or self.max_entries_per_poll < 1 or self.log_lines_kept < 1:
            raise ValueError("consensus monitor bounds must be >= 1")


@dataclass(frozen=True)
class ConsensusCounters:
    """Monotonic totals for metrics (supervise_consensus_*_total)."""

    comparisons: int  # steps decided across the group (agreed or diverged)
    mismatches: int  # steps on which ranks disagreed (published or caught in progress)
    verdicts: int  # verdicts returned (the first diverging step of each episode)
    in_progress_verdicts: int  # of which caught before the step ended
    expired: int  # steps dropped unconfirmed (a rank never published them)
    entries_read: int  # digests read from the rings
    entries_lost: int  # digests overwritten before the monitor read them
    logs_unavailable: int  # event logs of a diverging step no longer in a ring
    rings_open: int  # rings currently mapped


class _Slot:
    """What the monitor knows about one heartbeat slot's ring."""

    def __init__(self, slot: int, path: Path):
        self.slot = slot
        self.path = path
        self.reader: RingReader | None = None
        self.next_index = 0
        self.checked_at: float | None = None
        self.reset_open()

    def reset_open(self) -> None:
        self.open_key: tuple[int, int] | None = None  # (head, open_pos) of the open step read
        self.open_lines: list[bytes] = []
        self.open_read = 0  # bytes of the open step parsed so far
        self.open_count = 0
        self.open_step = NO_STEP


class _Group:
    def __init__(self, members: Sequence[int], config: MonitorConfig):
        self.table: StepTable[RingEntry] = StepTable(members, config.mismatch_wait_s, config.max_pending_steps)
        self.open = OpenStepComparer(members, config.mismatch_wait_s)
        self.caught_in_progress: set[int] = set()  # steps already counted as mismatches


class ConsensusMonitor:
    """Compares per-step digests across the ranks of each TP group.

    ``groups`` lists the slots of each TP group (default: one group of all
    ``nslots`` slots).  ``poll`` and ``settle`` may be called from different
    threads (an uncontended lock serialises them); ``counters()`` reads
    without it.
    """

    def __init__(
        self,
        run_dir: Path,
        nslots: int,
        groups: Sequence[Sequence[int]] | None = None,
        config: MonitorConfig = MonitorConfig(),
    ):
        if nslots < 1:
            raise ValueError("a consensus monitor needs at least one slot")
        groups = [list(range(nslots))] if groups is None else [list(g) for g in groups]
        seen: set[int] = set()
        for group in groups:
            for slot in group:
                if not 0 <= slot < nslots or slot in seen:
                    raise ValueError(f"slot {slot} is outside 0..{nslots - 1} or in two groups")
                seen.add(slot)
        self.config = config
        self._lock = threading.Lock()
        self._slots = [_Slot(s, ring_path(run_dir, s)) for s in range(nslots)]
        self._groups = [_Group(g, config) for g in groups if g]
        self._group_of = {slot: g for g in self._groups for slot in g.table.members}
        self._comparisons = 0
        self._mismatches = 0
        self._verdicts = 0
        self._in_progress_verdicts = 0
        self._expired = 0
        self._entries_read = 0
        self._entries_lost = 0
        self._logs_unavailable = 0
        # Steps every rank of the (single) group agreed on, for the cross-node
        # comparison (consensus.across_nodes); None: nobody asked, none kept.
        self._agreed: deque[tuple[int, bytes]] | None = None

    # -- reading the rings -----------------------------------------------------
    def _refresh(self, st: _Slot, now: float) -> None:
        if st.reader is not None and st.checked_at is not None and now - st.checked_at < self.config.rescan_interval_s:
            return
        st.checked_at = now
        try:
            stat = os.stat(st.path)
        except FileNotFoundError:
            return
        if st.reader is not None and st.reader.inode == (stat.st_dev, stat.st_ino):
            return
        try:
            reader = RingReader(st.path)
        except (OSError, RingLayoutError) as exc:
            log.warning("consensus ring unreadable", slot=st.slot, error=repr(exc))
            return
        group = self._group_of.get(st.slot)
        if st.reader is not None:
            log.info("consensus ring replaced", slot=st.slot, pid=reader.header.pid)
            st.reader.close()
            if group is not None:
                group.table.reset_member(st.slot)
                group.open.forget(st.slot)
        st.reader = reader
        st.next_index = 0  # _drain counts what the ring no longer holds as lost
        st.reset_open()

    def _drain(self, st: _Slot, now: float) -> None:
        reader = st.reader
        group = self._group_of.get(st.slot)
        if reader is None or group is None:
            return
        head = reader.head()
        oldest = head - reader.header.depth
        if st.next_index < oldest:
            self._entries_lost += oldest - st.next_index
            st.next_index = oldest
        stop = min(head, st.next_index + self.config.max_entries_per_poll)
        for index in range(st.next_index, stop):
            entry = reader.read_entry(index)
            if entry is None:
                if not reader.lapped(index):
                    break  # torn: the writer is inside this entry (or was stopped there); retry next poll
                self._entries_lost += 1
                st.next_index = index + 1
                continue
            self._entries_read += 1
            group.table.add(st.slot, entry.step, entry.digest, entry.count, entry, now)
            st.next_index = index + 1

    def _read_open(self, st: _Slot) -> None:
        """Parse the events of the rank's step in progress that are new since the last poll."""
        reader = st.reader
        group = self._group_of.get(st.slot)
        if reader is None or group is None:
            return
        state = reader.read_state()
        if state is None:
            return
        key = (state.head, state.open_pos)
        if key != st.open_key:
            st.reset_open()
            st.open_key = key
        if state.open_len > st.open_read:
            data = reader.read_range(state.open_pos + st.open_read, state.open_len - st.open_read)
            if data is None:  # cannot happen while the step stays under its log share
                st.reset_open()
                return
            st.open_lines.extend(encoding.split_log(data))
            st.open_read = state.open_len
        st.open_count = state.open_count
        st.open_step = state.open_step
        group.open.update(st.slot, state.last_step, st.open_lines)

    def rank_of(self, slot: int) -> int:
        """Global rank of ``slot`` as its ring says (the slot index before it has one)."""
        reader = self._slots[slot].reader
        return reader.header.rank if reader is not None else slot

    # -- deciding ------------------------------------------------------------
    def poll(self, now: float) -> list[DivergenceVerdict]:
        """Read what the ranks published or recorded since the last call; return new verdicts."""
        return self._poll(now, force=False)

    def settle(self, now: float) -> list[DivergenceVerdict]:
        """Like ``poll`` but judges every mismatch now, without waiting for late ranks.

        Call it when a rank exited or the group hung: a divergence it returns
        came first and is the root cause.
        """
        return self._poll(now, force=True)

    def _poll(self, now: float, force: bool) -> list[DivergenceVerdict]:
        with self._lock:
            verdicts = self._poll_locked(now, force)
        for verdict in verdicts:
            log.warning(
                "consensus divergence",
                step=verdict.step,
                in_progress=verdict.in_progress,
                culprit_ranks=list(verdict.culprit_ranks),
                verdict=verdict.verdict,
            )
        return verdicts

    def _poll_locked(self, now: float, force: bool) -> list[DivergenceVerdict]:
        for st in self._slots:
            try:
                self._refresh(st, now)
                self._drain(st, now)
                self._read_open(st)
            except (OSError, ValueError) as exc:  # one bad ring must not stop the others
                log.warning("consensus ring read failed", slot=st.slot, error=repr(exc))
        verdicts: list[DivergenceVerdict] = []
        for group in self._groups:
            for decision in group.table.decide(now, force):
                verdict = self._account(group, decision, now)
                if verdict is not None:
                    verdicts.append(verdict)
            for open_decision in group.open.decide(now, force):
                verdict = self._account_open(group, open_decision, now)
                if verdict is not None:
                    verdicts.append(verdict)
        return verdicts

    def _account(self, group: _Group, decision: Decision[RingEntry], now: float) -> DivergenceVerdict | None:
        if decision.outcome is Outcome.EXPIRED:
            self._expired += 1
            return None
        self._comparisons += 1
        if decision.outcome is Outcome.AGREE and self._agreed is not None and not decision.missing:
            self._agreed.append((decision.step, next(iter(decision.digests.values()))))
        if decision.outcome is not Outcome.DIVERGED:
            return None
        if decision.step in group.caught_in_progress:
            group.caught_in_progress.discard(decision.step)
        else:
            self._mismatches += 1
        if not decision.first_of_episode:
            return None
        self._verdicts += 1
        return self._verdict(decision, now)

    def _account_open(self, group: _Group, decision: OpenDecision, now: float) -> DivergenceVerdict | None:
        if group.table.in_episode:
            return None  # the divergence goes on; its first step was reported
        group.table.enter_episode()
        verdict = self._open_verdict(decision, now)
        self._mismatches += 1
        self._verdicts += 1
        self._in_progress_verdicts += 1
        group.caught_in_progress = {s for s in group.caught_in_progress if s >= verdict.step}
        group.caught_in_progress.add(verdict.step)
        return verdict

    def _verdict(self, decision: Decision[RingEntry], now: float) -> DivergenceVerdict:
        digests: dict[int, bytes] = {}
        counts: dict[int, int] = {}
        logs: dict[int, list[bytes] | None] = {}
        notes: dict[int, str] = {}
        published_at = 0.0
        for slot, entry in decision.refs.items():
            rank = self.rank_of(slot)
            digests[rank] = decision.digests[slot]
            counts[rank] = decision.counts[slot]
            published_at = max(published_at, entry.ts)
            reader = self._slots[slot].reader
            blob = reader.read_log(entry) if reader is not None else None
            if blob is None:
                self._logs_unavailable += 1
                logs[rank], notes[rank] = None, "event log overwritten before it was read"
                continue
            lines = encoding.split_log(blob)
            if entry.truncated:
                notes[rank] = f"log truncated to its first {len(lines)} of {entry.count} events"
            logs[rank] = lines
        missing = [self.rank_of(s) for s in decision.missing]
        return build_verdict(
            decision.step,
            digests,
            counts,
            logs,
            notes,
            missing,
            now,
            published_at,
            keep_lines=self.config.log_lines_kept,
        )

    def _open_verdict(self, decision: OpenDecision, now: float) -> DivergenceVerdict:
        digests, counts, logs = {}, {}, {}
        announced = set()
        for slot in decision.lines:
            st = self._slots[slot]
            rank = self.rank_of(slot)
            lines = list(st.open_lines)
            # ranks agree before ``index``: the digest of the prefix through it splits them by that event
            digests[rank] = encoding.digest(encoding.join_log(lines[: decision.index + 1]))
            counts[rank] = st.open_count
            logs[rank] = lines
            announced.add(st.open_step)
        step = announced.pop() if len(announced) == 1 and NO_STEP not in announced else decision.after + 1
        missing = [self.rank_of(s) for s in decision.missing]
        return build_verdict(
            step,
            digests,
            counts,
            logs,
            {},
            missing,
            now,
            now,
            keep_lines=self.config.log_lines_kept,
            in_progress=True,
        )

    # -- reporting -------------------------------------------------------------
    def counters(self) -> ConsensusCounters:
        return ConsensusCounters(
            comparisons=self._comparisons,
            mismatches=self._mismatches,
            verdicts=self._verdicts,
            in_progress_verdicts=self._in_progress_verdicts,
            expired=self._expired,
            entries_read=self._entries_read,
            entries_lost=self._entries_lost,
            logs_unavailable=self._logs_unavailable,
            rings_open=sum(1 for st in self._slots if st.reader is not None),
        )

    def keep_agreed(self, limit: int = 8192) -> None:
        """From now on remember the steps all ranks agreed on (at most ``limit`` untaken)."""
        if len(self._groups) != 1:
            raise ValueError("cross-node comparison needs one TP group per node")
        with self._lock:
            self._agreed = deque(maxlen=limit)

    def take_agreed(self) -> list[tuple[int, bytes]]:
        """(step, digest) of the steps agreed since the last call, oldest first."""
        with self._lock:
            if not self._agreed:
                return []
            out = list(self._agreed)
            self._agreed.clear()
            return out

    def rings_open(self) -> bool:
        """Whether any rank records consensus events (a lock-free read: a hint for the poll rate only)."""
        return any(st.reader is not None for st in self._slots)

    def counts(self) -> tuple[int, int]:
        """(comparisons, mismatches): the two totals exported as metrics."""
        return self._comparisons, self._mismatches

    def close(self) -> None:
        """Unmap the rings (the files belong to the run directory)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for st in self._slots:
            if st.reader is not None:
                st.reader.close()
                st.reader = None
