"""Environment contract between the supervisor and the rank-side recorder.

The supervisor merges :func:`rank_env` into each rank's environment; the rank
reads it back with :meth:`RankConsensusSpec.from_env`.  Variables::

    SUPERVISE_CONSENSUS                off | observe | enforce (ranks record in both
                                       observe and enforce; only the supervisor's
                                       reaction differs)
    SUPERVISE_CONSENSUS_RING           path of this rank's digest ring (created by the rank)
    SUPERVISE_CONSENSUS_DEPTH          steps kept in the ring (digests and event logs)
    SUPERVISE_CONSENSUS_LOG_BYTES      size of the ring's event-log area
    SUPERVISE_CONSENSUS_INBAND         in-band check every N steps (0: off); benchmark only
    SUPERVISE_CONSENSUS_SLOT           heartbeat slot of this rank (ring header, sanity)
    SUPERVISE_CONSENSUS_DIR            tree mode (slot unknown at launch): the ring
                                       directory; the rank derives its slot from
                                       SUPERVISE_SLOT, or RANK - SUPERVISE_SLOT_BASE
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_MODE = "SUPERVISE_CONSENSUS"
ENV_RING = "SUPERVISE_CONSENSUS_RING"
ENV_DEPTH = "SUPERVISE_CONSENSUS_DEPTH"
ENV_LOG_BYTES = "SUPERVISE_CONSENSUS_LOG_BYTES"
ENV_INBAND = "SUPERVISE_CONSENSUS_INBAND"
ENV_SLOT = "SUPERVISE_CONSENSUS_SLOT"
ENV_DIR = "SUPERVISE_CONSENSUS_DIR"
# Set by the supervisor for the runtime (supervisor/rank/runtime.py); read here, not imported,
# to keep this module free of supervisor imports.
ENV_RUNTIME_SLOT = "SUPERVISE_SLOT"
ENV_RUNTIME_SLOT_BASE = "SUPERVISE_SLOT_BASE"

RING_DIR = "consensus"
DEFAULT_DEPTH = 64
DEFAULT_LOG_BYTES = 2 * 1024 * 1024
MIN_LOG_BYTES = 4096
MAX_DEPTH = 1 << 16


class ConsensusMode(str, enum.Enum):
    """``--consensus``: what the supervisor does about a divergence."""

    OFF = "off"
    OBSERVE = "observe"  # bundle + metric, the engine keeps running
    ENFORCE = "enforce"  # also tear the group down, exit 82

    @classmethod
    def parse(cls, text: str) -> ConsensusMode:
        try:
            return cls(text.strip().lower())
        except ValueError:
            choices = "|".join(m.value for m in cls)
            raise ValueError(f"consensus mode must be one of {choices}, not {text!r}") from None


def ring_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RING_DIR


def ring_path(run_dir: str | os.PathLike, slot: int) -> Path:
    """Where the digest ring of heartbeat slot ``slot`` lives."""
    return ring_dir(run_dir) / f"slot-{slot}.ring"


def _tree_slot(environ: Mapping[str, str]) -> int | None:
    """The slot of a rank launched by a launcher (tree mode), from the runtime's env."""
    slot = environ.get(ENV_RUNTIME_SLOT)
    if slot:
        return int(slot)
    rank = environ.get("RANK")
    if rank is None:
        return None
    return int(rank) - int(environ.get(ENV_RUNTIME_SLOT_BASE, "0") or 0)


@dataclass(frozen=True)
class RankConsensusSpec:
    """What one rank needs to record and publish (validated on construction)."""

    mode: ConsensusMode
    ring: Path | None
    slot: int = 0
    depth: int = DEFAULT_DEPTH
    log_bytes: int = DEFAULT_LOG_BYTES
    inband_every: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"consensus depth must be in [1, {MAX_DEPTH}], not {self.depth}")
        if self.log_bytes < MIN_LOG_BYTES:
            raise ValueError(f"consensus log area must be >= {MIN_LOG_BYTES} bytes, not {self.log_bytes}")
        if self.inband_every < 0:
            raise ValueError(f"in-band interval must be >= 0, not {self.inband_every}")
        if self.slot < 0:
            raise ValueError(f"slot must be >= 0, not {self.slot}")

    @property
    def publishes(self) -> bool:
        """Out of band: digests go to the supervisor through the ring."""
        return self.mode is not ConsensusMode.OFF and self.ring is not None

    @property
    def records(self) -> bool:
        return self.publishes or self.inband_every > 0

    def to_env(self) -> dict[str, str]:
        env = {
            ENV_MODE: self.mode.value,
            ENV_SLOT: str(self.slot),
            ENV_DEPTH: str(self.depth),
            ENV_LOG_BYTES: str(self.log_bytes),
            ENV_INBAND: str(self.inband_every),
        }
        if self.ring is not None:
            env[ENV_RING] = os.fspath(self.ring)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RankConsensusSpec:
        """Parse the rank's environment; a missing mode means off."""
        mode = ConsensusMode.parse(environ.get(ENV_MODE, "") or ConsensusMode.OFF.value)
        ring = Path(environ[ENV_RING]) if environ.get(ENV_RING) else None
        slot = int(environ.get(ENV_SLOT, "") or 0)
        directory = environ.get(ENV_DIR)
        if ring is None and directory and mode is not ConsensusMode.OFF:
            tree_slot = _tree_slot(environ)
            if tree_slot is not None and tree_slot >= 0:
                slot = tree_slot
                ring = Path(directory) / f"slot-{slot}.ring"
        return cls(
            mode=mode,
            ring=ring,
            slot=slot,
            depth=int(environ.get(ENV_DEPTH, "") or DEFAULT_DEPTH),
            log_bytes=int(environ.get(ENV_LOG_BYTES, "") or DEFAULT_LOG_BYTES),
            inband_every=int(environ.get(ENV_INBAND, "0") or 0),
        )


def rank_env(
    run_dir: Path,
    slot: int,
    mode: str | ConsensusMode,
    *,
    inband_every: int = 0,
    depth: int = DEFAULT_DEPTH,
    log_bytes: int = DEFAULT_LOG_BYTES,
) -> dict[str, str]:
    """Environment for the rank in heartbeat slot ``slot``; merge it into the rank's env.

    ``mode`` off gives a dict that turns recording off (unless ``inband_every``
    asks for the in-band benchmark mode, which records but publishes nothing).
    A negative ``slot`` (tree mode: unknown at launch) lets each rank derive
    its slot from the runtime's environment.
    """
    parsed = mode if isinstance(mode, ConsensusMode) else ConsensusMode.parse(mode)
    publish = parsed is not ConsensusMode.OFF
    spec = RankConsensusSpec(
        mode=parsed,
        ring=ring_path(run_dir, slot) if publish and slot >= 0 else None,
        slot=max(slot, 0),
        depth=depth,
        log_bytes=log_bytes,
        inband_every=inband_every,
    )
    env = spec.to_env()
    if slot < 0:
        del env[ENV_SLOT]
        if publish:
            env[ENV_DIR] = os.fspath(ring_dir(run_dir))
    return env
