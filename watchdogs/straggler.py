"""Straggler (fail-slow) detection: which rank the group waits for.  Pure; time is an argument.

The supervisor reads each rank's arrival ring (``HeartbeatSegment.arrivals``:
when the rank entered each of its latest collectives) at every watchdog tick
and calls::

    report = detector.observe(windows, now, step_s)

``now`` is the monotonic time taken just *before* the slots were read;
``windows`` the ``ArrivalWindow`` of every live rank of this node (pass
``since=detector.since(rank)`` to the reader so that only new entries are
copied); ``step_s`` the group's step time when ranks report steps, else None
(it only goes into the sentence).  ``report.events`` holds one ``named``
event when a rank's straggler episode starts and one ``cleared`` when it ends.
docs/watchdogs.md ("Stragglers") has the long form; in short:

* **Same collective, all ranks.**  A collective number ``n`` is judged once
  every expected rank (those with collectives, in this call's windows) has
  arrived at it.  A rank that has not yet arrived holds the judgement back (it
  may be the late one); one that went past ``n`` without the reader seeing its
  arrival (its ring moved on between two reads) drops ``n``: collectives are
  sampled, never judged without a rank.  At most ``max_per_observe`` (the
  newest) are judged per call.
* **Lag**: a rank's arrival minus the median arrival of its peers (the other
  ranks: with two ranks, the other one).  **Wait**: at each collective the
  last rank to arrive kept every peer waiting for ``last - second last``.
* **Buckets** of ``bucket_s`` by the collective's first arrival.  Per rank
  and bucket, its **share**: the time its peers spent waiting for it over the
  busy time between consecutive collectives (an interval longer than its
  wait by more than ``idle_gap_s`` is idle, not counted).  A rank late by
  ``L`` once per step of ``T`` has a share of ``L / T``: the share is its lag
  relative to the step, summed over the step's collectives.
* **Baseline**: each rank's normal share, a low quantile (``BASELINE_QUANTILE``)
  of its past buckets (after ``warmup_s``; buckets in which it was over the
  threshold are not learned): a slowdown that starts while the baseline is
  learned is not taken for the rank's normal pace unless it filled nearly all
  of the learning time.  Its **excess** is its share minus its baseline.
* **Over** (one bucket): ``excess >= threshold`` and ``excess - median of the
  peers' excess >= threshold``: the rank costs the group a ``threshold``
  share of its time more than it usually does, and more than its peers'
  changes explain.  A role that is uneven by design (rank 0 detokenising)
  is in its baseline; a change every rank sees (longer steps, jitter) is in
  the peers' excess.
* **Episode**: named once it was over for ``sustain_s`` of busy time
  (each bucket counts at most ``bucket_s``; once it is building up, a bucket
  between the clear level and the threshold neither counts nor breaks the
  run, and one bucket below the clear level is tolerated); cleared after
  ``clear_s`` of busy time below
  ``clear_ratio * threshold``.
* **Gross**: with or without a baseline, named once, over its latest
  ``sustain_s`` of busy time (warm-up buckets included), the group waited
  for it ``gross_share`` of that time and a threshold more than for its
  peers.  A rank slowed several times over, from its first steps or while
  its baseline is learned, is named by this, ``sustain_s`` or less after it
  turned slow; taken over the whole window, not bucket by bucket, because
  a CPU-starved rank's share varies per bucket and is well below its
  slowdown (part of it falls inside the collectives, after its arrival:
  a rank at 15 % of a CPU, 6x slower, costs 40-65 % of the group's time as
  the arrivals count it).  Without a baseline its episode is cleared after
  ``clear_s`` below ``clear_ratio`` of the gross share.

Not stragglers, by construction: an idle group (no collective, no bucket),
the first ``warmup_s`` of a rank's process, then ``baseline_min_s`` of
learning (unless gross); a long step every rank shares (nobody waits); a hang (a rank that
does not arrive holds every judgement back, so nothing is said: the hang
watchdog's); a single long wait (at most ``bucket_s`` of one bucket counts).
Ranks whose collective counts drift more than ``max_count_spread`` apart run
different sequences (pipeline stages) and are not compared (``unaligned``).

Across nodes: ``straggler_nodes`` (per-node summaries built from a report and
``StragglerDetector.references()``, merged into one judgement).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tp_supervise.supervisor.rank.heartbeat import ARRIVAL_DEPTH, ArrivalWindow

NAMED = "named"
CLEARED = "cleared"
BASELINE_QUANTILE = 0.1  # of the learned buckets' shares: a rank's baseline
LAG_SAMPLES = 32  # lags kept per rank and bucket (systematic sampling)
LATE_SAMPLES = 16  # lags-when-late kept per rank and bucket
REF_STRIDES = (64, 1024, 16384)  # reference collectives for the cross-node comparison
REF_KEEP = 8  # per stride


@dataclass(frozen=True)
class StragglerConfig:
    """What counts as a straggler (defaults documented in docs/watchdogs.md, "Stragglers")."""

    threshold: float | None = 0.10  # share of the group's time; None: off (statistics only)
    # A rank its peers waited for this share of their time over its latest sustain_s (and a threshold more than
    # they wait for each other) is named even without a learned baseline: a rank slow from its first steps, or
    # turned slow while its baseline is learned, would otherwise learn its slowness as its baseline.  40 %:
    # above the roles uneven by design the tests and the benchmark run (25-32 %, 31 % at most over 20 s on a
    # loaded host), below what a rank starved to 15 % of a CPU costs as the arrivals count it (40-65 %).
    gross_share: float = 0.4
    window_s: float = 30.0  # statistics reported (lag distribution, late fraction, share)
    sustain_s: float = 20.0
    clear_s: float = 10.0
    clear_ratio: float = 0.5
    bucket_s: float = 1.0
    warmup_s: float = 10.0
    baseline_min_s: float = 10.0
    baseline_buckets: int = 600
    late_floor_s: float = 100e-6
    idle_gap_s: float = 2.0
    min_bucket_collectives: int = 2
    max_count_spread: int = ARRIVAL_DEPTH // 2
    max_per_observe: int = ARRIVAL_DEPTH
    max_buffered: int = 8 * ARRIVAL_DEPTH  # per rank, while another rank holds the judgement back

    def __post_init__(self) -> None:
        if self.threshold is not None and not (0.0 < self.threshold < 1.0):
            raise ValueError(f"threshold must be a share in (0, 1) or None (off), got {self.threshold!r}")
        for name in ("window_s", "sustain_s", "clear_s", "bucket_s", "idle_gap_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("warmup_s", "baseline_min_s", "late_floor_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if not 0.0 < self.gross_share <= 1.0:
            raise ValueError(f"gross_share must be in (0, 1], got {self.gross_share}")
        if not 0.0 < self.clear_ratio <= 1.0:
            raise ValueError(f"clear_ratio must be in (0, 1], got {self.clear_ratio}")
        if self.bucket_s > self.sustain_s or self.bucket_s > self.window_s:
            raise ValueError("bucket_s must not exceed sustain_s nor window_s")
        for name in (
            "baseline_buckets",
            "min_bucket_collectives",
            "max_count_spread",
            "max_per_observe",
            "max_buffered",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class RankLag:
    """One rank over the last ``window_s`` (closed buckets), as reports, metrics and sentences use it."""

    rank: int
    collectives: int  # judged, with this rank among the expected ones
    lag_p50_s: float
    lag_p90_s: float
    lag_p99_s: float
    late_fraction: float  # of those collectives, arrived last by at least late_floor_s
    late_lag_s: float  # its lateness where it was last, weighted by the waiting it caused (_wait_median; 0.0: never)
    wait_share: float  # of the group's busy time, spent waiting for this rank
    baseline_share: float | None  # its usual share (None while learning)
    excess_share: float | None  # in the latest judged bucket
    named: bool

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "collectives": self.collectives,
            "lag_p50_seconds": self.lag_p50_s,
            "lag_p90_seconds": self.lag_p90_s,
            "lag_p99_seconds": self.lag_p99_s,
            "late_fraction": self.late_fraction,
            "late_lag_seconds": self.late_lag_s,
            "wait_share": self.wait_share,
            "baseline_share": self.baseline_share,
            "excess_share": self.excess_share,
            "named": self.named,
        }


def sentence(lag: RankLag, step_s: float | None = None) -> str:
    """ "rank 3 arrives 41 ms late at 97 % of collectives (step 120 ms, 34 % of it waiting for rank 3)"."""
    head = f"rank {lag.rank} arrives {_ms(lag.late_lag_s)} late at {_pct(lag.late_fraction)} of collectives"
    if step_s is not None and step_s > 0:
        tail = f"step {_ms(step_s)}, {_pct(lag.wait_share)} of it waiting for rank {lag.rank}"
    else:
        tail = f"{_pct(lag.wait_share)} of the group's time waiting for rank {lag.rank}"
    if lag.baseline_share is not None and lag.baseline_share >= 0.01:
        tail += f"; usually {_pct(lag.baseline_share)}"
    return f"{head} ({tail})"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms" if ms >= 0.1 else f"{ms:.2f} ms"


def _pct(share: float) -> str:
    return f"{share * 100:.0f} %"


@dataclass(frozen=True)
class StragglerEvent:
    """A straggler episode starts (``named``) or ends (``cleared``): one bundle per ``named``."""

    kind: str
    rank: int
    at: float  # the ``now`` of the call that decided
    lag: RankLag  # the window's numbers when it was decided
    step_s: float | None
    since: float | None = None  # named: when the run of buckets that named it began (the lag's window)

    def sentence(self) -> str:
        if self.kind == NAMED:
            return sentence(self.lag, self.step_s)
        return (
            f"rank {self.rank} no longer holds the group back ({_pct(self.lag.wait_share)} of the time waiting for it)"
        )

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "at": self.at,
            "sentence": self.sentence(),
            "step_seconds": self.step_s,
            "since": self.since,
            "lag": self.lag.to_dict(),
        }


@dataclass(frozen=True)
class StragglerReport:
    """What one ``observe`` call concluded."""

    at: float
    state: str  # off | waiting | unaligned | held | learning | ok | straggler
    events: tuple[StragglerEvent, ...]
    ranks: Mapping[int, RankLag]  # the window's statistics, refreshed when a bucket closes
    named: frozenset[int]
    step_s: float | None = None

    def sentence(self, rank: int) -> str:
        return sentence(self.ranks[rank], self.step_s) if rank in self.ranks else f"rank {rank}: no arrivals judged"

    def to_dict(self) -> dict:
        return {
            "at": self.at,
            "state": self.state,
            "events": [e.to_dict() for e in self.events],
            "ranks": {str(r): lag.to_dict() for r, lag in sorted(self.ranks.items())},
            "named": sorted(self.named),
            "step_seconds": self.step_s,
        }


# -- state ----------------------------------------------------------------------------------------


class _Bucket:
    """What the collectives whose first arrival fell in one bucket showed."""

    __slots__ = ("index", "span", "colls", "ranks", "wait", "late", "late_lags", "lags", "stride")

    def __init__(self, index: int) -> None:
        self.index = index
        self.span = 0.0  # busy seconds between consecutive judged collectives
        self.colls = 0
        self.ranks: set[int] = set()
        self.wait: dict[int, float] = {}
        self.late: dict[int, int] = {}
        self.late_lags: dict[int, list[float]] = {}
        self.lags: dict[int, list[float]] = {}
        self.stride = 1  # lags are sampled at every stride-th collective (doubles when full)


@dataclass
class _Rank:
    pid: int
    lane: int
    count: int = 0  # the latest collective number its window showed
    high: int = 0  # the highest number whose arrival we hold or judged
    segs: deque = field(default_factory=deque)  # [first number, arrivals] runs, ascending
    first_bucket: int | None = None
    baseline: deque = field(default_factory=deque)
    named: bool = False
    over_s: float = 0.0
    run_start: int = 0  # bucket index where the current run over the threshold began
    under_s: float = 0.0
    misses: int = 0
    excess: float | None = None
    gross: deque = field(default_factory=deque)  # (bucket index, busy s, share * busy, contrast * busy), newest last

    def arrival(self, seq: int) -> float | None:
        """Its arrival at ``seq``; runs below ``seq`` are dropped (judgement goes upward)."""
        segs = self.segs
        while segs:
            start, values = segs[0]
            i = seq - start
            if i < len(values):
                return values[i] if i >= 0 else None
            segs.popleft()
        return None

    def peek(self, seq: int) -> float | None:
        for start, values in self.segs:
            i = seq - start
            if i < len(values):
                return values[i] if i >= 0 else None
        return None

    def next_held(self) -> int | None:
        return self.segs[0][0] if self.segs else None

    def buffered(self) -> int:
        return sum(len(v) for _s, v in self.segs)


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _wait_median(late_lags: Sequence[float]) -> float:
    """The lag below which half of the waiting these late arrivals caused lies (each weighted by itself): a rank
    late by 8 ms at one collective of each step and by a few hundred microseconds of noise at others "arrives
    8 ms late", where the plain median would say 0.4 ms."""
    ordered = sorted(x for x in late_lags if x > 0)
    half, acc = sum(ordered) / 2, 0.0
    for x in ordered:
        acc += x
        if acc >= half:
            return x
    return 0.0


def _baseline(learned: Sequence[float]) -> float:
    """A rank's usual share: a low quantile of its learned buckets, so that a slowdown that began while the
    baseline was being learned is not all taken for its normal pace (a role uneven by design costs its share in
    every bucket, so its low quantile is that share)."""
    return _quantile(sorted(learned), BASELINE_QUANTILE)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class StragglerDetector:
    """Per node: judges the ranks' arrivals at the same collectives (module docstring)."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._ranks: dict[int, _Rank] = {}
        self._next = 1  # the next collective number to judge
        self._open: dict[int, _Bucket] = {}
        self._closed: deque[_Bucket] = deque(maxlen=max(1, math.ceil(self.config.window_s / self.config.bucket_s)))
        self._prev: tuple | None = (
            None  # (number, first arrival, wait, last rank, bucket, last arrival) of the last judged
        )
        self._latest_first = -math.inf
        self._stats: dict[int, RankLag] = {}
        self._refs: dict[int, deque] = {stride: deque(maxlen=REF_KEEP) for stride in REF_STRIDES}
        self._unaligned = False
        self._pending_since: float | None = None  # first arrival of a collective some rank has not reached
        self._baseline_min = max(1, math.ceil(self.config.baseline_min_s / self.config.bucket_s))  # buckets

    def since(self, rank: int) -> int:
        """The highest collective number of ``rank`` already taken (the reader's ``since``)."""
        rs = self._ranks.get(rank)
        return rs.high if rs is not None else 0

    # -- one call per tick --------------------------------------------------------------------

    def observe(
        self, windows: Iterable[ArrivalWindow | None], now: float, step_s: float | None = None
    ) -> StragglerReport:
        events: list[StragglerEvent] = []
        expected = self._ingest([w for w in windows if w is not None], now, events)
        if len(expected) >= 2 and not self._unaligned:
            self._judge_collectives(expected)
        self._close_buckets(now, expected, events, step_s)
        return StragglerReport(
            now,
            self._state(expected, now),
            tuple(events),
            dict(self._stats),
            frozenset(r for r, rs in self._ranks.items() if rs.named),
            step_s,
        )

    def _ingest(self, windows: list[ArrivalWindow], now: float, events: list[StragglerEvent]) -> list[int]:
        for w in windows:
            rs = self._ranks.get(w.rank)
            if rs is None or rs.pid != w.pid or rs.lane != w.lane:
                if rs is not None and rs.named:  # its process (or thread) is gone: the episode ends
                    events.append(StragglerEvent(CLEARED, w.rank, now, self._lag(w.rank, False), None))
                self._ranks[w.rank] = rs = _Rank(w.pid, w.lane, baseline=deque(maxlen=self.config.baseline_buckets))
                self._restart()  # its numbers start again from 1
            rs.count = w.count
            start = max(w.first_seq, rs.high + 1, self._next)
            if start <= w.last_seq:
                values = list(w.arrivals[start - w.first_seq :])
                last = rs.segs[-1] if rs.segs else None
                if last is not None and last[0] + len(last[1]) == start:
                    last[1].extend(values)
                else:
                    rs.segs.append([start, values])
                rs.high = w.last_seq
            while rs.buffered() > self.config.max_buffered:
                rs.segs.popleft()
        expected = sorted(w.rank for w in windows if w.count > 0)
        counts = [self._ranks[r].count for r in expected]
        spread = max(counts) - min(counts) if counts else 0
        self._unaligned = spread > self.config.max_count_spread
        if self._unaligned:  # different sequences (or a restart under way): nothing to compare, nothing to keep
            self._restart()
        return expected

    def _restart(self) -> None:
        """Judge from what the next windows hold (the numbers jump forward at once: ``_judge_collectives``)."""
        for rs in self._ranks.values():
            rs.segs.clear()
            rs.high = 0
        self._next = 1
        self._prev = None

    def _judge_collectives(self, expected: list[int]) -> None:
        ranks = [self._ranks[r] for r in expected]
        reached = min(rs.count for rs in ranks)  # every expected rank arrived at the numbers up to this
        limit = self.config.max_per_observe
        if reached - self._next + 1 > limit:  # judge the newest ones only
            self._next = reached - limit + 1
            self._prev = None
        seq = self._next
        while seq <= reached:
            arrivals = []
            skip_to = 0
            for rs in ranks:
                t = rs.arrival(seq)
                if t is None:  # it went past seq unseen: seq is lost, and so is every number below its next run
                    held = rs.next_held()
                    skip_to = max(skip_to, held if held is not None and held > seq else rs.count + 1)
                    continue
                arrivals.append(t)
            if skip_to:
                seq = max(skip_to, seq + 1)
                self._prev = None
                continue
            self._judge(seq, expected, arrivals)
            seq += 1
        self._next = seq

    def _judge(self, seq: int, ranks: list[int], arrivals: list[float]) -> None:
        cfg = self.config
        n = len(arrivals)
        order = sorted(range(n), key=arrivals.__getitem__)
        v = [arrivals[i] for i in order]
        first, last_rank = v[0], ranks[order[-1]]
        wait = v[-1] - v[-2]
        b = self._bucket(first)
        prev = self._prev
        if prev is not None and prev[0] == seq - 1:
            _pseq, pfirst, pwait, plast, pb, plast_at = prev
            interval = first - pfirst
            # Peers waited for the last rank only if nobody entered this collective before it entered the
            # previous one: ranks that do not meet in their collectives (not one group, or work issued ahead
            # of its wait) are not judged by their waits.
            if 0.0 <= interval and interval - pwait <= cfg.idle_gap_s and first >= plast_at:
                pb.span += interval
                pb.wait[plast] = pb.wait.get(plast, 0.0) + pwait
        self._prev = (seq, first, wait, last_rank, b, v[-1])
        if first > self._latest_first:
            self._latest_first = first
        b.colls += 1
        b.ranks.update(ranks)
        m = n - 1  # peers of a rank
        k = m // 2
        if wait >= cfg.late_floor_s:
            peers_median = v[k] if m % 2 else (v[k - 1] + v[k]) / 2
            b.late[last_rank] = b.late.get(last_rank, 0) + 1
            late = b.late_lags.setdefault(last_rank, [])
            if len(late) < LATE_SAMPLES:
                late.append(v[-1] - peers_median)
        if b.colls % b.stride == 0:
            full = False
            for pos in range(n):
                if m % 2:
                    med = v[k] if k < pos else v[k + 1]
                else:
                    lo = v[k - 1] if k - 1 < pos else v[k]
                    hi = v[k] if k < pos else v[k + 1]
                    med = (lo + hi) / 2
                lags = b.lags.setdefault(ranks[order[pos]], [])
                lags.append(v[pos] - med)
                full = full or len(lags) >= LAG_SAMPLES
            if full:
                for r, lags in b.lags.items():
                    b.lags[r] = lags[::2]
                b.stride *= 2
        for stride, refs in self._refs.items():
            if seq % stride == 0:
                refs.append((seq, tuple(zip(ranks, arrivals, strict=True))))

    def _bucket(self, first: float) -> _Bucket:
        index = math.floor(first / self.config.bucket_s)
        if self._closed and index <= self._closed[-1].index:  # out of order (async issue): the oldest open one
            index = min(self._open) if self._open else self._closed[-1].index + 1
        b = self._open.get(index)
        if b is None:
            b = self._open[index] = _Bucket(index)
        return b

    # -- buckets: statistics, judgement, episodes --------------------------------------------------

    def _close_buckets(
        self, now: float, expected: list[int], events: list[StragglerEvent], step_s: float | None
    ) -> None:
        cfg = self.config
        # The frontier: every collective that began before it has been judged.  With one that some
        # ranks reached and others not yet (pending), its first arrival; else the latest judged, or
        # what the read saw (``now`` is taken before reading: a bucket of grace).  A rank that never
        # arrives (a hang) keeps the frontier where it is: nothing closes, nothing is said.
        pending = [t for r in expected if (t := self._ranks[r].peek(self._next)) is not None]
        frontier = min(pending) if pending else max(self._latest_first, now - cfg.bucket_s)
        self._pending_since = min(pending) if pending else None
        closed_any = False
        for index in sorted(self._open):
            if (index + 1) * cfg.bucket_s > frontier:
                break
            b = self._open[index]
            if self._prev is not None and self._prev[4] is b:
                if pending:
                    break  # its last collective's interval ends at the pending one
                self._prev = None  # idle after it: that interval is not busy time
            del self._open[index]
            self._closed.append(b)
            closed_any = True
            self._judge_bucket(b, now, events, step_s)
        if closed_any:
            self._stats = {r: self._lag(r, self._ranks[r].named) for r in self._ranks if self._seen(r)}

    def _judge_bucket(self, b: _Bucket, now: float, events: list[StragglerEvent], step_s: float | None) -> None:
        cfg = self.config
        if b.span <= 0.0 or b.colls < cfg.min_bucket_collectives or len(b.ranks) < 2:
            return
        learning_after = cfg.warmup_s / cfg.bucket_s
        contribution = min(b.span, cfg.bucket_s)
        shares = {r: b.wait.get(r, 0.0) / b.span for r in b.ranks if r in self._ranks}
        judged: set[int] = set()
        excess: dict[int, float] = {}
        for r, share in shares.items():
            rs = self._ranks[r]
            if rs.first_bucket is None:
                rs.first_bucket = b.index
            if b.index - rs.first_bucket < learning_after:
                continue  # warm-up: neither judged nor learned (the gross window still sees it)
            judged.add(r)
            if len(rs.baseline) >= self._baseline_min:
                excess[r] = share - _baseline(rs.baseline)
        f = cfg.threshold
        for r, share in shares.items():
            rs = self._ranks[r]
            others = [s for p, s in shares.items() if p != r]
            contrast = share - _median(others) if others else 0.0
            gross = self._gross(rs, b.index, contribution, share, contrast)
            if r not in judged:
                continue
            ex = rs.excess = excess.get(r)
            if f is None:  # off: statistics only
                if not rs.named:
                    rs.baseline.append(share)
                continue
            peers = [e for p, e in excess.items() if p != r]
            peer_ex = _median(peers) if peers else None
            gross_bucket = share >= cfg.gross_share and contrast >= f
            low = f * cfg.clear_ratio
            if ex is not None and peer_ex is not None:
                over = gross_bucket or (ex >= f and ex - peer_ex >= f)
                still = gross_bucket or (ex >= low and ex - peer_ex >= low)
            else:  # no baseline: against the gross share (the clear level of it, once named)
                over = gross_bucket
                still = share >= cfg.gross_share * cfg.clear_ratio and contrast >= low
            if rs.named:
                rs.under_s = 0.0 if still else rs.under_s + contribution
                if rs.under_s >= cfg.clear_s:
                    rs.named = False
                    rs.over_s = rs.under_s = 0.0
                    rs.gross.clear()
                    events.append(StragglerEvent(CLEARED, r, now, self._lag(r, False), step_s))
                continue
            if gross is not None:  # the group waited for it grossly over the last sustain_s: named
                self._name(r, rs, now, events, step_s, since=gross)
                continue
            if ex is None or peer_ex is None:  # learning: only the gross window can name it
                if not gross_bucket:
                    rs.baseline.append(share)
                continue
            if over:
                if rs.over_s == 0.0:
                    rs.run_start = b.index
                rs.over_s += contribution
                rs.misses = 0
            elif still and rs.over_s > 0.0:
                pass  # between the clear level and the threshold while building up: neither counted nor learned
            else:
                rs.baseline.append(share)
                rs.misses += 1
                if rs.misses > 1:
                    rs.over_s = 0.0
            if rs.over_s >= cfg.sustain_s:
                self._name(r, rs, now, events, step_s, since=rs.run_start)

    def _gross(self, rs: _Rank, index: int, contribution: float, share: float, contrast: float) -> int | None:
        """Adds a bucket to the rank's gross window (its latest ``sustain_s`` of busy time, warm-up included);
        the window's first bucket when, over all of it, the group waited for the rank ``gross_share`` of its time
        and a threshold more than for its peers (None: not gross, or not ``sustain_s`` seen yet)."""
        cfg = self.config
        window = rs.gross
        window.append((index, contribution, share * contribution, contrast * contribution))
        while sum(c for _i, c, _s, _k in window) - window[0][1] >= cfg.sustain_s:
            window.popleft()
        busy = sum(c for _i, c, _s, _k in window)
        if cfg.threshold is None or busy < cfg.sustain_s * (1 - 1e-9):
            return None
        if sum(s for _i, _c, s, _k in window) < cfg.gross_share * busy:
            return None
        if sum(k for _i, _c, _s, k in window) < cfg.threshold * busy:
            return None
        return window[0][0]

    def _name(
        self, r: int, rs: _Rank, now: float, events: list[StragglerEvent], step_s: float | None, since: int
    ) -> None:
        rs.named = True
        rs.under_s = 0.0
        lag = self._lag(r, True, since=since)
        events.append(StragglerEvent(NAMED, r, now, lag, step_s, since * self.config.bucket_s))

    def _seen(self, rank: int) -> bool:
        return any(rank in b.ranks for b in self._closed)

    def _lag(self, rank: int, named: bool, since: int | None = None) -> RankLag:
        """Its numbers over the window's buckets (from bucket ``since`` on: the run that named it)."""
        colls = late = 0
        span = wait = 0.0
        lags: list[float] = []
        late_lags: list[float] = []
        for b in self._closed:
            if rank not in b.ranks or (since is not None and b.index < since):
                continue
            colls += b.colls
            late += b.late.get(rank, 0)
            span += b.span
            wait += b.wait.get(rank, 0.0)
            lags.extend(b.lags.get(rank, ()))
            late_lags.extend(b.late_lags.get(rank, ()))
        lags.sort()
        rs = self._ranks.get(rank)
        baseline = _baseline(rs.baseline) if rs is not None and len(rs.baseline) >= self._baseline_min else None
        return RankLag(
            rank=rank,
            collectives=colls,
            lag_p50_s=_quantile(lags, 0.5),
            lag_p90_s=_quantile(lags, 0.9),
            lag_p99_s=_quantile(lags, 0.99),
            late_fraction=late / colls if colls else 0.0,
            late_lag_s=_wait_median(late_lags),
            wait_share=wait / span if span > 0 else 0.0,
            baseline_share=baseline,
            excess_share=rs.excess if rs is not None else None,
            named=named,
        )

    def _state(self, expected: list[int], now: float) -> str:
        if any(rs.named for rs in self._ranks.values()):
            return "straggler"
        if self.config.threshold is None:
            return "off"
        if len(expected) < 2:
            return "waiting"
        if self._unaligned:
            return "unaligned"
        if self._pending_since is not None and now - self._pending_since > 2 * self.config.bucket_s:
            return "held"  # a rank has not arrived for seconds: a hang or a long wait, not judged here
        if any(len(self._ranks[r].baseline) < self._baseline_min for r in expected):
            return "learning"
        return "ok"

    # -- across nodes (``straggler_nodes``) ----------------------------------------------------------

    def references(self) -> dict[int, tuple[tuple[int, float], ...]]:
        """Arrivals (local clock) at the latest judged collectives whose number is a multiple of one of
        ``REF_STRIDES``: every node keeps the same numbers, so nodes can compare them."""
        refs = {}
        for stride_refs in self._refs.values():
            for seq, pairs in stride_refs:
                refs[seq] = pairs
        return dict(sorted(refs.items()))
