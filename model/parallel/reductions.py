"""Reductions over vocabulary-sharded logits (SPEC.md section 7).

Every function takes this rank's slice `x: [..., n_r]` of the logits, whose first column is global id
`vocab_start`, and returns the statistic of the whole vocabulary, identical on every rank. At world
size 1 no collective is issued. -inf entries (filtered tokens) are allowed everywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from model.batch_invariant import row_sum
from model.parallel.group import TPGroup

_NO_ID = torch.iinfo(torch.int64).max


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


def topk(x: torch.Tensor, k: int, vocab_start: int, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries, descending, equal values ordered by lowest global id; merged from each
    rank's own top k."""
    values, ids = _local_topk(x, k, vocab_start)
    if not tp.is_parallel:
        return values, ids
    # [tp, ..., k] -> [..., tp * k] in rank order, i.e. ascending ids among equal values.
    all_values = torch.movedim(tp.all_gather(values), 0, -2).flatten(-2)
    all_ids = torch.movedim(tp.all_gather(ids), 0, -2).flatten(-2)
    # by id first (padding ids are the largest), then stably by value: equal values keep id order
    by_id = torch.sort(all_ids, dim=-1, stable=True).indices
    all_values, all_ids = torch.gather(all_values, -1, by_id), torch.gather(all_ids, -1, by_id)
    order = torch.sort(all_values, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.gather(all_values, -1, order), torch.gather(all_ids, -1, order)


def _local_topk(x: torch.Tensor, k: int, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A stable sort keeps equal values in id order; torch.topk gives no such promise.
    n = min(k, x.shape[-1])
    sorted_ = torch.sort(x, dim=-1, descending=True, stable=True)
    values, ids = sorted_.values[..., :n], sorted_.indices[..., :n] + vocab_start
    if n < k:  # a shard narrower than k: pad with entries that lose every comparison
        pad = (*x.shape[:-1], k - n)
        values = torch.cat([values, x.new_full(pad, -torch.inf)], dim=-1)
        ids = torch.cat([ids, ids.new_full(pad, _NO_ID)], dim=-1)
    return values, ids
