"""In-band consensus check: the design we compare against (benchmark only).

Every N steps each rank all-reduces its step index and digest with MIN and
with MAX through a CPU (gloo) group; the ranks agree iff both results are
equal.  This is what an in-engine checker does (SGLang's opt-in checker is of
this kind).  Its costs are what the out-of-band design avoids: two extra
collectives on the hot path per check, and no answer at all once the group is
hung, because the check itself is a collective.  ``fused=True`` gets the same
answer from one MAX all-reduce of ``[x, -x]`` (max and minus the min).

torch is imported lazily: importing this module is free.
"""

from __future__ import annotations

import struct
from typing import Any

from .encoding import DIGEST_SIZE

_WORDS = struct.Struct(f"<{DIGEST_SIZE // 4}I")  # digest as u32 words: no overflow when negated in int64


def world_cpu_group() -> Any:
    """A gloo group over the whole world (the default group itself when it is gloo)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


class InbandChecker:
    """``check(step, digest)`` every ``every_n`` steps through ``group``.

    Every rank of the group must call ``check`` with the same step sequence
    (a collective runs on checked steps).
    """

    def __init__(self, group: Any, every_n: int, fused: bool = False):
        if every_n < 1:
            raise ValueError(f"in-band interval must be >= 1, not {every_n}")
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.group = group
        self.every_n = every_n
        self.fused = fused
        self.checks = 0
        self.mismatches = 0

    def _values(self, step: int, digest: bytes) -> list[int]:
        return [step, *_WORDS.unpack(digest[:DIGEST_SIZE].ljust(DIGEST_SIZE, b"\0"))]

    def check(self, step: int, digest: bytes) -> bool:
        """True when every rank of the group has the same step and digest (or no check is due)."""
        if step % self.every_n:
            return True
        torch, dist = self._torch, self._dist
        values = self._values(step, digest)
        if self.fused:
            both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
            n = len(values)
            agree = torch.equal(both[:n], -both[n:])
        else:
            low = torch.tensor(values, dtype=torch.int64)
            high = low.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
            agree = torch.equal(low, high)
        self.checks += 1
        if not agree:
            self.mismatches += 1
        return agree
