"""Temperature and candidate filters on vocabulary-sharded logits (docs/spec.md 3.1-3.2), without sorting.

Top-k and top-p are decided on the values a family decides them on (masked diffusion: logits / T;
DiffusionGemma: the softcapped logits, before its temperature) and become one threshold per position: a
row keeps the entries at or above it (-inf: no filter), in the scaled and unscaled logits alike. A
threshold is an entry's own value, found by a radix select over the values' order-preserving integer
keys, four bits a pass from the top: each pass totals (counts, or sums of probability) the entries at or
above 16 candidate keys on this rank's slice, and one SUM all-reduce makes the totals global. The passes
here are torch's (CPU, and the reference); model/kernels/filters.py runs the search in triton on CUDA.
"""
from __future__ import annotations

from typing import Callable

import torch

from model.batch_invariant import row_sum
from model.parallel import reductions as R
from model.parallel.group import TPGroup

DIGIT = 4              # key bits decided per pass
CANDIDATES = 1 << DIGIT


def mask_token(x: torch.Tensor, token_id: int, vocab_start: int) -> None:
    """The mask token is never predicted: its logit is -inf (in place, on the rank that owns it)."""
    local = token_id - vocab_start
    if 0 <= local < x.shape[-1]:
        x[..., local] = -torch.inf


def _rows(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[R] -> [R, 1, ...] broadcastable against `like` ([R, ...])."""
    return v.to(like.device).view(-1, *[1] * (like.dim() - 1))


def _softcap(u: torch.Tensor, cap: float | None) -> torch.Tensor:
    # times 1 / cap, not / cap: what torch's CUDA division by a Python scalar computes anyway (its CPU
    # division rounds otherwise), and what the triton passes compute, so every device and path agrees
    # -inf stays -inf: a token a grammar refuses (docs/spec.md 12) stays impossible past the cap
    return u if cap is None else torch.where(u == -torch.inf, u, torch.tanh(u * (1.0 / cap)) * cap)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32, or the input's own precision where higher (an fp64 model stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """T of s = u / T: the row's temperature, 1 for greedy rows (T = 0)."""
    return torch.where(temperature > 0, temperature, 1.0)


def unscaled(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """u: fp32 (fp64 for fp64 logits), softcapped; what filters are decided on (DiffusionGemma) or
    divided by T (Nemotron)."""
    return _softcap(upcast(x), softcap)


# ---- order-preserving integer keys ---------------------------------------------------------------

_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def value_keys(v: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the float values v (-0 as +0), in [-2^(b-1), 2^(b-1)) for b-bit floats."""
    v = v + 0.0   # -0 -> +0: equal values, equal keys
    bits = v.view(_INT_OF[v.element_size()]).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ ((1 << (8 * v.element_size() - 1)) - 1))


def key_values(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of value_keys: the values of `dtype` whose keys these are."""
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.where(keys >= 0, keys, keys ^ ((1 << (8 * size - 1)) - 1))
    return bits.to(_INT_OF[size]).view(dtype)


def radix_select(at_least: Callable[[torch.Tensor, int], torch.Tensor], target: torch.Tensor, bits: int,
                 shape: torch.Size, tp: TPGroup, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest key t (of `bits`-bit keys) with total(keys >= t) >= target, per position [*shape].
    at_least(candidates [*shape, 16], shift) -> this rank's totals at or above each candidate; totals
    only grow as a candidate falls. Returns (t, reached): reached is False where even every key together
    falls short of the target (then t means nothing)."""
    prefix = torch.full(shape, -(1 << (bits - 1)), dtype=torch.int64, device=device)
    digits = torch.arange(CANDIDATES, dtype=torch.int64, device=device)
    reached = None
    for shift in range(bits - DIGIT, -1, -DIGIT):
        totals = tp.all_reduce(at_least(prefix.unsqueeze(-1) + (digits << shift), shift))
        ok = totals >= target.unsqueeze(-1)
        if reached is None:        # the first candidate is the smallest key: everything
            reached = ok[..., 0]
        prefix = prefix + ((ok.sum(-1) - 1).clamp(min=0) << shift)
    return prefix, reached


# ---- the thresholds (torch: CPU, and the reference) ----------------------------------------------

def top_k_threshold(base: torch.Tensor, k: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[R, ...]: the k-th largest of base [R, ..., V_r] per row position, -inf where k <= 0 or k is
    more entries than there are."""
    keys = value_keys(base)

    def at_least(candidates, shift):
        return torch.stack([(keys >= candidates[..., d:d + 1]).sum(-1) for d in range(CANDIDATES)], -1)

    target = _rows(k.clamp(min=1), base[..., 0])
    t, reached = radix_select(at_least, target, 8 * base.element_size(), base.shape[:-1], tp, base.device)
    return torch.where((_rows(k, t) > 0) & reached, key_values(t, base.dtype), -torch.inf)


def top_p_threshold(base: torch.Tensor, p: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[R, ...]: the largest value t of base [R, ..., V_r] (-inf entries: filtered already) with
    P(base >= t) >= p under softmax(base), -inf where p >= 1."""
    keys = value_keys(base)
    probs = torch.exp(base - R.logsumexp(base, tp).unsqueeze(-1))

    def at_least(candidates, shift):
        return torch.stack([row_sum(torch.where(keys >= candidates[..., d:d + 1], probs, 0), torch.float64)
                            for d in range(CANDIDATES)], -1)

    target = _rows(p, base[..., 0]).to(torch.float64)
    t, reached = radix_select(at_least, target, 8 * base.element_size(), base.shape[:-1], tp, base.device)
    return torch.where((_rows(p, t) < 1) & reached, key_values(t, base.dtype), -torch.inf)


def keep_threshold(base: torch.Tensor, vocab_start: int, tp: TPGroup, top_k: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None) -> torch.Tensor:
    """base [R, ..., V_r] (the values filters are decided on) -> [R, ...]: the smallest value a row keeps
    (-inf: no filter); top_k / top_p [R] (None: no row filters so)."""
    threshold = torch.full(base.shape[:-1], -torch.inf, dtype=base.dtype, device=base.device)
    if top_k is not None:
        threshold = top_k_threshold(base, top_k, tp)
    if top_p is not None:
        kept = torch.where(base >= threshold.unsqueeze(-1), base, -torch.inf)
        threshold = torch.maximum(threshold, top_p_threshold(kept, top_p, tp))
    return threshold


def torch_threshold(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    vocab_start: int, tp: TPGroup, *, softcap: float | None = None,
                    on_scaled: bool = True) -> torch.Tensor:
    """The sampler's pass (model.sampling.stats.VocabPasses.threshold): raw logits x [R, P, V_r] -> each
    position's threshold [R, P] (fp32), in the space the filters are decided in: the softcapped logits
    u, divided by the row's temperature where `on_scaled`."""
    base = unscaled(x, softcap)
    if on_scaled:
        base = base / effective_temperature(temperature).view(-1, 1, 1).to(base.dtype)
    return keep_threshold(base, vocab_start, tp, top_k, top_p)


def scale_and_filter(logits: torch.Tensor, temperature: torch.Tensor, vocab_start: int, tp: TPGroup,
                     top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None):
    """logits: [R, ..., Vr] fp32; temperature/top_k/top_p: [R]. Returns (unscaled, scaled), both filtered
    (the dense statement of docs/spec.md 3.2 that the sampler's thresholds implement)."""
    scaled = logits / _rows(torch.where(temperature > 0, temperature, 1.0), logits)
    if top_k is None and top_p is None:
        return logits, scaled
    keep = scaled >= keep_threshold(scaled, vocab_start, tp, top_k, top_p).unsqueeze(-1)
    return torch.where(keep, logits, -torch.inf), torch.where(keep, scaled, -torch.inf)
