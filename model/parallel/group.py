"""The tensor-parallel group one rank belongs to: every collective of a model goes through it.

At world size 1 no process group is needed and no collective is ever issued, so a single-GPU (or CPU)
model pays nothing for tensor parallelism. On CUDA with NCCL, small sums go through a one-shot
all-reduce over symmetric memory when the group starts with one (model/parallel/small_allreduce.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model import batch_invariant
from model.parallel.small_allreduce import OneShotAllReduce, start_small_allreduce


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    small: OneShotAllReduce | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tp rank {self.rank} outside world size {self.world_size}")
        if self.world_size > 1 and self.group is None and not dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1 needs an initialised torch.distributed process group")

    @classmethod
    def from_default_group(cls, device: torch.device | str = "cpu", small_allreduce: bool | None = None
                           ) -> "TPGroup":
        """The whole default process group as one TP group (or world size 1 without one). On `device` cuda
        with NCCL the group starts its one-shot path for small sums (collective; small_allreduce None:
        on unless DLLM_SMALL_ALLREDUCE=0) and logs which path it uses."""
        if not dist.is_initialized():
            return cls()
        rank, world_size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
        return cls(rank=rank, world_size=world_size, group=group,
                   small=start_small_allreduce(group, rank, world_size, device, small_allreduce))

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place; returns x for chaining. A sum in batch-invariant mode adds the ranks' parts in rank
        order (NCCL's order depends on the message size, so on the batch); otherwise a message the
        one-shot path takes goes through it, any other through the process group's backend."""
        if not self.is_parallel:
            return x
        if op == dist.ReduceOp.SUM and batch_invariant.enabled():
            return x.copy_(batch_invariant.sum_in_order(self.all_gather(x)))
        if self.small is not None and self.small.takes(x, op):
            return self.small(x)
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
