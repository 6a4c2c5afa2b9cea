"""Reductions over vocabulary-sharded logits that only tests use (the served path's are in
model/parallel/reductions.py, and the sampler's one-pass statistics in model/sampling/stats.py):
`gather_vocab` to compare TP = N logits with TP = 1, and the others as the sharded statistics checked
against dense torch in tests/test_reductions.py and tests/test_tensor_parallel.py.

Each takes this rank's slice `x: [..., n_r]` of the logits, whose first column is global id
`vocab_start`, and returns the statistic of the whole vocabulary, identical on every rank; at world
size 1 no collective is issued.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from model.batch_invariant import row_sum
from model.parallel.group import TPGroup
from model.parallel.reductions import global_max

_NO_ID = torch.iinfo(torch.int64).max   # loses every MIN over ids


def entropy(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """H(softmax(x)) = m + log Z - A / Z with Z = sum e^(s-m), A = sum e^(s-m) s; computed as
    log Z - A' / Z with A' = sum e^(s-m) (s-m), the same value without cancelling large logits."""
    m = global_max(x, tp)
    shifted = x - torch.where(torch.isfinite(m), m, 0).unsqueeze(-1)
    e = torch.exp(shifted)
    za = torch.stack([row_sum(e), row_sum(torch.where(e > 0, e * shifted, 0))])
    z, a = tp.all_reduce(za)
    return torch.log(z) - a / z


def argmax(x: torch.Tensor, vocab_start: int, tp: TPGroup) -> torch.Tensor:
    """Global ids of the maximum, the lowest id among equal maxima (torch.argmax returns the first)."""
    local = torch.argmax(x, dim=-1)
    if not tp.is_parallel:
        return local + vocab_start
    value = torch.gather(x, -1, local.unsqueeze(-1)).squeeze(-1)
    best = global_max(x, tp)
    candidate = torch.where(value == best, local + vocab_start, _NO_ID)
    return tp.all_reduce(candidate, dist.ReduceOp.MIN)


def value_at(x: torch.Tensor, ids: torch.Tensor, vocab_start: int, tp: TPGroup) -> torch.Tensor:
    """x[..., ids] where the global ids may live on any rank."""
    local = ids - vocab_start
    mine = (local >= 0) & (local < x.shape[-1])
    picked = torch.gather(x, -1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
    if not tp.is_parallel:
        return picked
    return tp.all_reduce(torch.where(mine, picked, -torch.inf), dist.ReduceOp.MAX)


def count_greater(x: torch.Tensor, threshold: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Number of vocabulary entries strictly above threshold[...] (a token's rank is 1 + this)."""
    return tp.all_reduce((x > threshold.unsqueeze(-1)).sum(dim=-1))


def gather_vocab(x: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """The full-vocabulary logits [..., V] on every rank (the serving path never materialises
    full-vocabulary tensors under TP)."""
    if not tp.is_parallel:
        return x
    width = -(-vocab_size // tp.world_size)
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=torch.nan)
    gathered = torch.movedim(tp.all_gather(padded), 0, -2)  # [..., tp, width]
    keep = [slice(0, (r + 1) * vocab_size // tp.world_size - r * vocab_size // tp.world_size)
            for r in range(tp.world_size)]
    return torch.cat([gathered[..., r, s] for r, s in enumerate(keep)], dim=-1)


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
