"""Temperature and candidate filters on vocabulary-sharded logits (SPEC.md 3.1-3.2).

`scaled = logits / T` (T = 1 for greedy rows, so greedy logprobs are those of the model's own
distribution); top-k and top-p are decided on `scaled`; filtered entries become -inf in both the
scaled and the unscaled logits. Both filters are computed from global statistics, so every rank
keeps exactly the ids a single rank would.
"""
from __future__ import annotations

import torch

from model.batch_invariant import row_sum
from model.parallel import reductions as R
from model.parallel.group import TPGroup

TOP_P_ITERATIONS = 40  # bisection halvings of the threshold interval: past fp32 resolution of logits


def mask_token(x: torch.Tensor, token_id: int, vocab_start: int) -> None:
    """The mask token is never predicted: its logit is -inf (in place, on the rank that owns it)."""
    local = token_id - vocab_start
    if 0 <= local < x.shape[-1]:
        x[..., local] = -torch.inf


def _rows(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[R] -> [R, 1, ...] broadcastable against `like` ([R, ...])."""
    return v.to(like.device).view(-1, *[1] * (like.dim() - 1))


def top_k_threshold(scaled: torch.Tensor, k: torch.Tensor, kmax: int, vocab_start: int,
                    tp: TPGroup) -> torch.Tensor:
    """Per row, the k-th largest value (k = 0: -inf, no filter). Values tied with it are kept too.
    kmax = max(k) comes from the host so that no device value decides a shape."""
    values, _ = R.topk(scaled, kmax, vocab_start, tp)
    index = (_rows(k, values).clamp(min=1) - 1).expand(*values.shape[:-1], 1)
    kth = torch.gather(values, -1, index).squeeze(-1)
    return torch.where(_rows(k, kth) > 0, kth, -torch.inf)


def top_p_threshold(scaled: torch.Tensor, p: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Per row, the largest t with P(scaled >= t) >= p: keeping `scaled >= t` keeps the smallest set of
    top tokens whose mass reaches p. Found by bisection on t with one all-reduce per halving."""
    lse = R.logsumexp(scaled, tp)
    probs = torch.exp(scaled - lse.unsqueeze(-1))
    p = _rows(p, lse).to(torch.float64)
    finite = torch.where(torch.isfinite(scaled), scaled, torch.inf)
    lo = -R.global_max(-finite, tp).to(torch.float64)            # mass(lo) = 1 >= p
    hi = R.global_max(scaled, tp).to(torch.float64)
    top_ok = _mass_at_least(probs, scaled, hi, tp) >= p          # the top value alone reaches p
    for _ in range(TOP_P_ITERATIONS):
        mid = (lo + hi) / 2
        ok = _mass_at_least(probs, scaled, mid, tp) >= p
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return torch.where(top_ok, hi, lo).to(scaled.dtype)


def _mass_at_least(probs: torch.Tensor, scaled: torch.Tensor, t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return tp.all_reduce(row_sum(torch.where(scaled >= t.unsqueeze(-1).to(scaled.dtype), probs, 0), torch.float64))


def keep_threshold(base: torch.Tensor, vocab_start: int, tp: TPGroup, top_k: torch.Tensor | None = None,
                   top_k_max: int = 0, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """base [R, ..., Vr] (the values filters are decided on) -> [R, ...]: the smallest value a row keeps
    (-inf: no filter); top_k / top_p [R] (None when no row uses them: work nobody asked for is skipped)."""
    threshold = torch.full(base.shape[:-1], -torch.inf, device=base.device)
    if top_k is not None:
        threshold = top_k_threshold(base, top_k, top_k_max, vocab_start, tp)
    if top_p is not None:
        kept = torch.where(base >= threshold.unsqueeze(-1), base, -torch.inf)
        # top_p = 1 keeps everything, even where fp32 masses of a top set already sum to 1
        p_threshold = torch.where(_rows(top_p >= 1, threshold), -torch.inf, top_p_threshold(kept, top_p, tp))
        threshold = torch.maximum(threshold, p_threshold)
    return threshold


def scale_and_filter(logits: torch.Tensor, temperature: torch.Tensor, vocab_start: int, tp: TPGroup,
                     top_k: torch.Tensor | None = None, top_k_max: int = 0, top_p: torch.Tensor | None = None):
    """logits: [R, ..., Vr] fp32; temperature/top_k/top_p: [R]. Returns (unscaled, scaled), both filtered
    (the dense statement of SPEC.md 3.2 that the sampler's thresholds implement)."""
    scaled = logits / _rows(torch.where(temperature > 0, temperature, 1.0), logits)
    if top_k is None and top_p is None:
        return logits, scaled
    keep = scaled >= keep_threshold(scaled, vocab_start, tp, top_k, top_k_max, top_p).unsqueeze(-1)
    return torch.where(keep, logits, -torch.inf), torch.where(keep, scaled, -torch.inf)
