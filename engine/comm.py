"""Process groups and the tensor-parallel collectives of the forward pass.

Collectives are plain ``torch.distributed`` calls: under the supervisor the
zero-code hook wraps them and reports op + shapes, so nothing here reports
them again.  The model group is gloo on CPU and NCCL on CUDA; a separate gloo
group carries the control plane (startup exchange, replicated request
broadcast), so control and model collectives can never pair up with each
other, even when one rank is out of step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import DistEnv
from .inject import FaultInjector


def init_groups(dist_env: DistEnv, device: str):
    """Join the default group; returns (model_group, control_group), both None at world size 1."""
    if dist_env.world_size == 1:
        return None, None
    backend = "nccl" if device == "cuda" else "gloo"
    device_id = torch.device("cuda", dist_env.local_rank) if device == "cuda" else None
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{dist_env.master_addr}:{dist_env.master_port}",
        rank=dist_env.rank,
        world_size=dist_env.world_size,
        device_id=device_id,
    )
    model_group = dist.group.WORLD
    control_group = dist.new_group(backend="gloo")
    return model_group, control_group


def destroy_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class TPComm:
    """The collectives of one tensor-parallel group (no-ops at size 1)."""

    def __init__(self, group, size: int, injector: FaultInjector | None = None):
        self.group = group
        self.size = size
        self._injector = injector

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum in place over the group (row-parallel outputs, vocabulary-parallel embedding)."""
        if self.size == 1:
            return x
        if self._injector is not None and self._injector.take_collective_skip():
            self._injector.block_after_skip()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_ids(self, ids: list[int], device: torch.device) -> list[int]:
        """Element-wise MIN of token ids over the group (``--sync-token-ids``)."""
        if self.size == 1 or not ids:
            return ids
        t = torch.tensor(ids, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()
