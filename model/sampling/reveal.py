"""Reveal policies of masked diffusion (docs/spec.md 3.5): which masked canvas positions take their
candidate token this step. Each policy is one function over a batch of rows, registered by name.

Inputs per row r and canvas position i: masked [R, C] bool; confidence [R, C] (log p of the
candidate, -inf where not masked); entropy [R, C] (only the entropy policy reads it); step n [R]
(0-based within the canvas) and N [R] (max denoising steps); tau [R]; gamma [R].
Every policy reveals every remaining mask on the last allowed step (n + 1 >= N): a commit never
holds a mask.
"""
from __future__ import annotations

from typing import Callable

import torch

from model.batch_invariant import row_cumsum

Policy = Callable[..., torch.Tensor]


# A row's reveal must be the same bits whether its step's state update runs compiled or as written
# (model/steps/compiled.py): which one runs depends on the whole batch's plan, a row's tokens must not.
# The reveal's two float ops whose kernels inductor would write its own way (a scan's order of
# additions, a log's rounding) are opaque to torch.compile, so both paths call torch's kernels.
@torch.library.custom_op("dllm::reveal_cumsum", mutates_args=())
def _cumsum(x: torch.Tensor) -> torch.Tensor:
    return row_cumsum(x)


@_cumsum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dllm::reveal_log", mutates_args=())
def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


@_log.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _rank_desc(score: torch.Tensor) -> torch.Tensor:
    """0-based rank of each position by score, highest first, lower position first among equals."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return torch.argsort(order, dim=-1)


def _k_per_step(masked: torch.Tensor, n: torch.Tensor, N: torch.Tensor) -> torch.Tensor:
    remaining = (N - n).clamp(min=1)
    return torch.div(masked.sum(-1) + remaining - 1, remaining, rounding_mode="floor")  # ceil


def threshold(masked, confidence, n, N, tau, **_) -> torch.Tensor:
    """p(x0) >= tau, plus always the single most confident position."""
    best = _rank_desc(torch.where(masked, confidence, -torch.inf)) == 0
    return masked & ((confidence >= _log(tau)[:, None]) | best)


def low_confidence(masked, confidence, n, N, **_) -> torch.Tensor:
    """The k = ceil(masked / (N - n)) most confident positions."""
    k = _k_per_step(masked, n, N)
    return masked & (_rank_desc(torch.where(masked, confidence, -torch.inf)) < k[:, None])


def leftmost(masked, n, N, **_) -> torch.Tensor:
    """The first k masked positions, left to right."""
    k = _k_per_step(masked, n, N)
    return masked & (torch.cumsum(masked.long(), -1) <= k[:, None])


def entropy_bound(masked, entropy, gamma, **_) -> torch.Tensor:
    """Positions by ascending entropy: the longest prefix with sum(H) - max(H) <= gamma, at least one."""
    h = torch.where(masked, entropy, torch.inf)
    order = torch.sort(h, dim=-1, stable=True).indices
    h_sorted = torch.gather(h, -1, order)
    finite = torch.where(torch.isfinite(h_sorted), h_sorted, 0)
    within = (_cumsum(finite) - finite) <= gamma[:, None]   # ascending: the prefix max is its last
    count = (within & torch.isfinite(h_sorted)).sum(-1).clamp(min=1)
    rank = torch.argsort(order, dim=-1)
    return masked & (rank < count[:, None])


POLICIES: dict[str, Policy] = {"threshold": threshold, "low_confidence": low_confidence, "leftmost": leftmost,
                               "entropy_bound": entropy_bound}
POLICY_IDS = {name: i for i, name in enumerate(POLICIES)}


def reveal(policy_id: torch.Tensor, present: list[str], masked: torch.Tensor, n: torch.Tensor,
           N: torch.Tensor, **stats) -> torch.Tensor:
    """Applies each row's own policy; only the policies `present` in the batch are computed."""
    out = torch.zeros_like(masked)
    for name in present:
        chosen = POLICIES[name](masked=masked, n=n, N=N, **stats)
        out = torch.where((policy_id == POLICY_IDS[name])[:, None], chosen, out)
    last = (n + 1 >= N)[:, None]
    return out | (masked & last)
