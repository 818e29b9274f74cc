"""Stragglers across nodes: per-node summaries merged into one judgement.  Pure.

Each node's supervisor judges its own ranks (``straggler.StragglerDetector``:
arrivals compared within the node, on one clock) and publishes a
``NodeSummary`` through the store at a bounded rate (``summarize``): per rank
its median lag, late fraction, share and whether it is named (with the
node's sentence), and its ranks' arrivals at *reference collectives* (the
numbers that are multiples of ``straggler.REF_STRIDES``, which every node
keeps alike) moved to a reference clock (node 0's) by the offset a store
round trip measured (``clock_offset``, ``best_offset``).  Every node runs
``merge_nodes`` over the summaries it has (its own included):

* a rank named by its node is named on every node, by global rank and node;
* a node as a whole is late when, at the reference collectives both sides
  judged, its median arrival trails the other nodes' median by more than
  ``max(min_node_lag_s, 3 x the two clocks' uncertainty)`` at most of them:
  arrivals on two clocks are only compared beyond what the offset could
  explain, never within a node.  Once a node's baseline is learned
  (``NodeBaselines``), the others must wait for it a threshold share of
  their time more than usual.

``NodeEpisodes`` decides what is said: a node is announced once it was late
at every merge for ``sustain_s``, and while its baseline is learned only at
``gross_share`` (a node uneven by design is learned, not named), as within a
node.

docs/watchdogs.md ("Stragglers", across nodes) has the long form.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .straggler import StragglerConfig, StragglerReport, _median, _ms, sentence


def summarize(
    report: StragglerReport,
    references: Mapping[int, tuple[tuple[int, float], ...]],
    node: int,
    clock_offset_s: float = 0.0,
    offset_error_s: float = 0.0,
) -> NodeSummary:
    """This node's summary: ``report`` (the detector's latest), ``references`` (``detector.references()``),
    times moved to the reference clock (local monotonic + ``clock_offset_s``, within ``offset_error_s``)."""
    ranks = tuple(
        RankSummary(
            r,
            lag.lag_p50_s,
            lag.late_fraction,
            lag.wait_share,
            lag.named,
            sentence(lag, report.step_s) if lag.named else "",
        )
        for r, lag in sorted(report.ranks.items())
    )
    refs = tuple((seq, tuple((r, t + clock_offset_s) for r, t in pairs)) for seq, pairs in sorted(references.items()))
    return NodeSummary(node, report.at + clock_offset_s, report.step_s, ranks, refs, offset_error_s)


@dataclass(frozen=True)
class RankSummary:
    rank: int  # global
    median_lag_s: float
    late_fraction: float
    wait_share: float
    named: bool
    sentence: str  # the node's verdict sentence when named


@dataclass(frozen=True)
class NodeSummary:
    """What a node publishes (through the store, at a bounded rate; ``to_dict`` is JSON-ready)."""

    node: int
    at: float  # reference clock
    step_s: float | None
    ranks: tuple[RankSummary, ...]
    references: tuple[tuple[int, tuple[tuple[int, float], ...]], ...]  # (number, ((rank, arrival), ...))
    offset_error_s: float

    def to_dict(self) -> dict:
        return {
            "node": self.node,
            "at": self.at,
            "step_seconds": self.step_s,
            "ranks": [[r.rank, r.median_lag_s, r.late_fraction, r.wait_share, r.named, r.sentence] for r in self.ranks],
            "references": [[seq, [[r, t] for r, t in pairs]] for seq, pairs in self.references],
            "offset_error_seconds": self.offset_error_s,
        }

    @classmethod
    def from_dict(cls, data: dict) -> NodeSummary:
        """Raises ValueError on anything that is not a node summary."""
        try:
            ranks = tuple(
                RankSummary(int(r), float(m), float(lf), float(ws), bool(nm), str(s))
                for r, m, lf, ws, nm, s in data["ranks"]
            )
            refs = tuple((int(seq), tuple((int(r), float(t)) for r, t in pairs)) for seq, pairs in data["references"])
            step = data.get("step_seconds")
            return cls(
                int(data["node"]),
                float(data["at"]),
                None if step is None else float(step),
                ranks,
                refs,
                float(data["offset_error_seconds"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a straggler node summary: {exc!r}") from None


@dataclass(frozen=True)
class LateNode:
    node: int
    ranks: tuple[int, ...]
    median_lag_s: float
    late: int  # reference collectives at which it was the last node, by more than the floor
    compared: int
    share: float = 0.0  # of the other nodes' time spent waiting for it

    def sentence(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks) or "?"
        return (
            f"node {self.node} (ranks {ranks}) arrives late at {self.late} of {self.compared} reference "
            f"collectives (median {_ms(self.median_lag_s)}; the other nodes wait {self.share * 100:.0f} % of "
            f"their time for it)"
        )


def _rate(refs: Mapping[int, Sequence[tuple[int, float]]]) -> float:
    """Collectives per second, from a node's references (numbers and their median arrivals)."""
    points = sorted((seq, _median([t for _r, t in pairs])) for seq, pairs in refs.items() if pairs)
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return 0.0
    return (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])


@dataclass(frozen=True)
class CrossNodeJudgement:
    named: tuple[tuple[int, int, str], ...]  # (node, global rank, sentence): named by its own node
    late_nodes: tuple[LateNode, ...]  # a whole node behind the others
    shares: Mapping[int, float] = field(default_factory=dict)  # node -> the others' time waiting for it

    def sentences(self) -> list[str]:
        return [f"node {node}: {text}" for node, _rank, text in self.named] + [n.sentence() for n in self.late_nodes]


def clock_offset(sent: float, remote: float, received: float) -> tuple[float, float]:
    """From one round trip (local ``sent``, the remote clock's reading ``remote``, local ``received``):
    ``(offset, error)`` such that remote time = local time + offset, within +- error."""
    return remote - (sent + received) / 2, max(0.0, (received - sent) / 2)


def merge_nodes(
    summaries: Sequence[NodeSummary],
    min_node_lag_s: float = 0.001,
    late_share: float = 0.8,
    min_compared: int = 3,
    share_threshold: float = 0.1,
    baselines: Mapping[int, float | None] | None = None,
    gross_share: float = StragglerConfig.gross_share,
) -> CrossNodeJudgement:
    """One judgement over every node's summary (each node runs it on what it received and its own).

    * ranks named by their own node (compared with their node's peers, one clock) are named for all;
    * a node as a whole is late when, at reference collectives every node judged, its median arrival
      trails the median of the other nodes' by at least ``max(min_node_lag_s, 3 x the clock
      uncertainty of the two)`` at ``late_share`` of at least ``min_compared`` of them, or the others
      spend ``share_threshold`` of their time waiting for it;
    * with ``baselines`` (node -> its usual share, ``NodeBaselines.values``), a node whose baseline is
      learned is late only when the others wait for it ``share_threshold`` of their time *more than
      usual* (or ``gross_share`` of it): a node whose role is uneven by design (it hosts the scheduler) is
      in its baseline.  While a baseline is being learned (``None``) the rules above apply.
    """
    named = tuple((s.node, r.rank, r.sentence) for s in summaries for r in s.ranks if r.named)
    by_node = {s.node: ({seq: pairs for seq, pairs in s.references}, s) for s in summaries}
    common: dict[int, dict[int, float]] = {}
    for node, (refs, _s) in by_node.items():
        for seq, pairs in refs.items():
            if pairs:
                common.setdefault(seq, {})[node] = _median([t for _r, t in pairs])
    late_nodes = []
    shares: dict[int, float] = {}
    for node, (_refs, s) in by_node.items():
        lags, floors = [], []
        for arrivals in common.values():
            if node not in arrivals or len(arrivals) < 2:
                continue
            others = [t for n, t in arrivals.items() if n != node]
            lags.append(arrivals[node] - _median(others))
            worst = max(by_node[n][1].offset_error_s for n in arrivals if n != node)
            floors.append(max(min_node_lag_s, 3 * (s.offset_error_s + worst)))
        if len(lags) < min_compared:
            continue
        late = sum(1 for lag, floor in zip(lags, floors, strict=True) if lag >= floor)
        median_lag = _median(lags)
        # The share of the others' time spent waiting for this node: the references are a sample of the
        # collectives, so the mean lag beyond the clocks' uncertainty per reference, times the collective
        # rate, is the waiting per second (a node late at one collective of each step has a small median lag
        # but a large share).
        waited = sum(lag for lag, floor in zip(lags, floors, strict=True) if lag >= floor) / len(lags)
        share = waited * _rate(by_node[node][0])
        shares[node] = share
        usual = None if baselines is None else baselines.get(node)
        if usual is None:
            is_late = (late >= late_share * len(lags) and median_lag >= _median(floors)) or share >= share_threshold
        else:
            is_late = share - usual >= share_threshold or share >= gross_share
        if is_late:
            ranks = tuple(r.rank for r in s.ranks) or tuple(
                sorted({r for _seq, pairs in s.references for r, _t in pairs})
            )
            late_nodes.append(LateNode(node, ranks, median_lag, late, len(lags), share))
    return CrossNodeJudgement(named, tuple(late_nodes), shares)


class NodeBaselines:
    """Each node's usual share of the others' time spent waiting for it.  For ``learn_s`` after a node is
    first seen every merge feeds its share (judged without a baseline meanwhile, so a node slow from the
    start is still named, once); then ``values`` gives the median of what was learned, and only merges in
    which the node is not judged late add to it.  Holds the last ``keep`` shares per node."""

    def __init__(self, learn_s: float = 20.0, keep: int = 300):
        self.learn_s = learn_s
        self.keep = keep
        self._first: dict[int, float] = {}
        self._shares: dict[int, deque[float]] = {}

    def observe(self, now: float, judgement: CrossNodeJudgement) -> None:
        late = {n.node for n in judgement.late_nodes}
        for node, share in judgement.shares.items():
            first = self._first.setdefault(node, now)
            if node in late and now - first >= self.learn_s:
                continue
            self._shares.setdefault(node, deque(maxlen=self.keep)).append(share)

    def values(self, now: float) -> dict[int, float | None]:
        return {
            node: _median(self._shares[node]) if now - first >= self.learn_s and self._shares.get(node) else None
            for node, first in self._first.items()
        }


class NodeEpisodes:
    """Which late nodes to announce, merge after merge (the straggler thread's every ``PUBLISH_EVERY_S``).

    As within a node (``straggler.StragglerDetector``): a node is announced once it was late at every merge
    for ``config.sustain_s``; while its baseline is learned (``NodeBaselines`` over ``config.baseline_min_s``,
    from the first merge) only at ``config.gross_share`` of the others' time, so a node whose role is uneven
    by design (it hosts the scheduler) becomes its baseline instead of an alarm, and a node slow from the
    start is still named when it costs the others that much.  ``judge`` returns the judgement with
    ``late_nodes`` cut to those sustained."""

    def __init__(self, config: StragglerConfig):
        self.config = config
        self.baselines = NodeBaselines(config.baseline_min_s)
        self._since: dict[int, float] = {}  # node -> the first merge of its current run of late merges

    def judge(self, summaries: Sequence[NodeSummary], now: float) -> CrossNodeJudgement:
        usual = self.baselines.values(now)
        judgement = merge_nodes(
            summaries,
            share_threshold=self.config.threshold or 1.0,
            baselines=usual,
            gross_share=self.config.gross_share,
        )
        self.baselines.observe(now, judgement)
        late = [n for n in judgement.late_nodes if usual.get(n.node) is not None or n.share >= self.config.gross_share]
        for node in set(self._since) - {n.node for n in late}:
            del self._since[node]
        for n in late:
            self._since.setdefault(n.node, now)
        sustained = tuple(n for n in late if now - self._since[n.node] >= self.config.sustain_s)
        return CrossNodeJudgement(judgement.named, sustained, judgement.shares)
