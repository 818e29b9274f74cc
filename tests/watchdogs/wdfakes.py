"""Synthetic heartbeat snapshots and a fake clock driver for the pure watchdog tests."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.watchdogs.policy import Verdict, VerdictKind, WatchdogConfig, WatchdogState, observe
from tp_supervise.watchdogs.progress import ExternalProgress

TICK = 0.1
BASE_PID = 1000


def snap(
    slot: int,
    *,
    step: int = 0,
    coll: int = 0,
    ready: bool = True,
    instrumented: bool = True,
    in_step: bool = False,
    in_coll: bool = False,
    finished: bool = False,
    claimed: bool = True,
    phase: str = "",
    op: str = "",
    desc: str = "",
    last_step: float = 0.0,
    ts_coll: float = 0.0,
    pid: int | None = None,
    torn: bool = False,
) -> hb.SlotSnapshot:
    flags = 0
    for on, bit in (
        (claimed, hb.CLAIMED),
        (ready, hb.READY),
        (instrumented, hb.INSTRUMENTED),
        (in_step, hb.IN_STEP),
        (in_coll, hb.IN_COLLECTIVE),
        (finished, hb.FINISHED),
    ):
        if on:
            flags |= bit
    return dataclasses.replace(
        hb.empty_slot(slot),
        pid=(BASE_PID + slot) if pid is None else pid,
        rank=slot if claimed else -1,
        flags=flags,
        step=step,
        coll_seq=coll,
        phase=phase,
        coll_op=op,
        coll_desc=desc,
        last_step_s=last_step,
        ts_coll_begin=ts_coll,
        torn=torn,
    )


class Driver:
    """Feeds observations to ``observe`` on a fake clock and keeps every verdict."""

    def __init__(self, config: WatchdogConfig, start: float = 1000.0):
        self.config = config
        self.now = start
        self.state = WatchdogState.initial(start)
        self.verdicts: list[Verdict] = []

    def tick(
        self,
        snaps: Sequence[hb.SlotSnapshot],
        dt: float = TICK,
        external: ExternalProgress | None = None,
        exited: Iterable[int] = (),
        cpu_wait_s: float = 0.0,
        helper_work_s: float = 0.0,
    ) -> Verdict:
        self.now += dt
        self.state, verdict = observe(
            self.state,
            snaps,
            self.now,
            self.config,
            external,
            frozenset(exited),
            cpu_wait_s=cpu_wait_s,
            helper_work_s=helper_work_s,
        )
        self.verdicts.append(verdict)
        return verdict

    def kinds(self) -> list[VerdictKind]:
        return [v.kind for v in self.verdicts]

    def fired(self) -> list[VerdictKind]:
        return [v.kind for v in self.verdicts if v.fired]

    def first(self, kind: VerdictKind) -> Verdict | None:
        return next((v for v in self.verdicts if v.kind is kind), None)


class SteadyGroup:
    """A TP group in a steady decode loop: every tick each rank completes steps and collectives."""

    def __init__(self, nranks: int = 2, colls_per_step: int = 4):
        self.nranks = nranks
        self.colls_per_step = colls_per_step
        self.step = 0

    def advance(self, step_s: float, dt: float = TICK) -> list[hb.SlotSnapshot]:
        """Snapshots after ``dt`` seconds of steps lasting ``step_s`` (at least one step per call)."""
        self.step += max(1, int(dt / step_s))
        return self.snapshot(in_step=True, last_step=step_s)

    def snapshot(self, in_step: bool = False, last_step: float = 0.0) -> list[hb.SlotSnapshot]:
        return [
            snap(r, step=self.step, coll=self.step * self.colls_per_step, in_step=in_step, last_step=last_step)
            for r in range(self.nranks)
        ]

    def stopped(self, stuck_rank: int, since: float) -> list[hb.SlotSnapshot]:
        """Peers entered the next all-reduce; ``stuck_rank`` never did (stopped outside collectives)."""
        out = []
        for r in range(self.nranks):
            if r == stuck_rank:
                out.append(snap(r, step=self.step, coll=self.step * self.colls_per_step, in_step=True))
            else:
                out.append(
                    snap(
                        r,
                        step=self.step,
                        coll=self.step * self.colls_per_step + 1,
                        in_step=True,
                        in_coll=True,
                        op="all_reduce",
                        desc="8x64 float32",
                        ts_coll=since,
                    )
                )
        return out


class ZeroCodeLoop:
    """A zero-code TP group: each rank enters one all_reduce per iteration and
    reports only its collective counter and when its latest collective began
    (``ts_coll_begin``, the rank's own clock), as the hook writes them.

    ``run(driver, seconds, iteration_s)`` advances the loop on the driver's
    clock, observing at every tick; ranks are between collectives (not busy)
    at the tick instants unless ``waiting`` says otherwise.
    """

    def __init__(self, nranks: int = 2):
        self.nranks = nranks
        self.coll = [0] * nranks
        self.ts = [0.0] * nranks

    def enter(self, rank: int, at: float, count: int = 1) -> None:
        self.coll[rank] += count
        self.ts[rank] = at

    def snapshot(self, waiting: dict[int, float] | None = None) -> list[hb.SlotSnapshot]:
        """``waiting``: rank -> when it entered the collective it is blocked in."""
        waiting = waiting or {}
        return [
            snap(
                r,
                coll=self.coll[r],
                ts_coll=self.ts[r],
                instrumented=False,
                ready=False,
                in_coll=r in waiting,
                op="all_reduce" if r in waiting else "",
            )
            for r in range(self.nranks)
        ]

    def run(self, d: Driver, seconds: float, iteration_s: float) -> None:
        """``seconds`` of the loop, one collective per rank every ``iteration_s``."""
        for _ in range(round(seconds / TICK)):
            end = d.now + TICK
            n = max(1, round(TICK / iteration_s))
            for r in range(self.nranks):
                self.enter(r, end - 0.001 * (r + 1), n)
            d.tick(self.snapshot())

    def stop(self, d: Driver, stopped_rank: int, seconds: float) -> None:
        """``stopped_rank`` never enters the next collective; its peers block inside it."""
        since = d.now + 0.001
        for r in range(self.nranks):
            if r != stopped_rank:
                self.enter(r, since)
        for _ in range(round(seconds / TICK)):
            d.tick(self.snapshot({r: since for r in range(self.nranks) if r != stopped_rank}))
