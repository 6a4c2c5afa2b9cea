"""The tensor-parallel group one rank belongs to.

At world size 1 no process group is needed and no collective is ever issued, so a single-GPU (or CPU)
model pays nothing for tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import batch_invariant


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tp rank {self.rank} outside world size {self.world_size}")
        if self.world_size > 1 and self.group is None and not dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1 needs an initialised torch.distributed process group")

    @classmethod
    def from_default_group(cls) -> "TPGroup":
        """The whole default process group as one TP group (or world size 1 without one)."""
        if not dist.is_initialized():
            return cls()
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), group=dist.group.WORLD)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place; returns x for chaining. A sum in batch-invariant mode adds the ranks' parts in rank
        order (NCCL's order depends on the message size, so on the batch)."""
        if not self.is_parallel:
            return x
        if op == dist.ReduceOp.SUM and batch_invariant.enabled():
            return x.copy_(batch_invariant.sum_in_order(self.all_gather(x)))
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Stacks every rank's x (same shape on all ranks) along a new leading dim: [world, *x.shape]."""
        if not self.is_parallel:
            return x.unsqueeze(0)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.is_parallel:
            dist.broadcast(x, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                           group=self.group)
        return x


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous slice of `size` rows. Slices differ by at most one row when
    size is not divisible (vocabularies) and are never empty while size >= world_size."""
    return rank * size // world_size, (rank + 1) * size // world_size
