"""Reductions over vocabulary-sharded logits (docs/spec.md section 7) that the sampler's filters use
(model/sampling/filters.py); the statistics a step reads come from model/sampling/stats.py.

Every function takes this rank's slice `x: [..., n_r]` of the logits, whose first column is global id
`vocab_start`, and returns the statistic of the whole vocabulary, identical on every rank. At world
size 1 no collective is issued. -inf entries (filtered tokens) are allowed everywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from model.batch_invariant import row_sum
from model.parallel.group import TPGroup


def global_max(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return tp.all_reduce(x.amax(dim=-1), dist.ReduceOp.MAX)


def _shifted_exp(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # A row that is -inf everywhere would give exp(nan); it cannot happen for a real distribution
    # (at least one token survives every filter), but keep such rows finite-safe.
    return torch.exp(x - torch.where(torch.isfinite(m), m, 0).unsqueeze(-1))


def logsumexp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    m = global_max(x, tp)
    z = tp.all_reduce(row_sum(_shifted_exp(x, m)))
    return m + torch.log(z)
