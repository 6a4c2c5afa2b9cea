"""Per-position statistics of vocabulary-sharded logits in one pass over each rank's slice (docs/spec.md
3.1-3.4, 4.1-4.4, 6, 7): the greedy argmax and the Gumbel-max sample, the log-normalisers and entropies
of softmax(u) and softmax(s = u / T), the self-conditioning normaliser and the sampled token's raw logit
(u: the softcapped or raw logits in fp32, filtered entries -inf).

A pass over a piece of the vocabulary yields two maxima as order-preserving int64 keys (the larger value,
then the lower id) and five sums of exponentials relative to the piece's own maximum. Pieces (a kernel's
splits, the ranks) combine in one MAX and one SUM all-reduce; nothing vocabulary-wide is gathered, and no
row's result depends on another's. The torch passes here are the reference (CPU's path); CUDA runs
model.kernels.vocab_stats' TRITON_PASSES.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from model.batch_invariant import row_sum
from model.parallel.group import TPGroup
from model.sampling.filters import upcast, effective_temperature, torch_threshold, unscaled
from model.sampling.noise import gumbel

_LOW32 = (1 << 32) - 1
# sums: z_u, a_u, z_s, a_s, z_soft (a_* = sum e^(v - m)(v - m): entropy without cancellation)
NUM_SUMS = 5


@dataclass
class VocabStats:
    greedy: torch.Tensor       # [R, P] int64 global ids
    sample: torch.Tensor       # [R, P] int64 global ids
    max_u: torch.Tensor        # [R, P] u[greedy]
    lse_u: torch.Tensor
    lse_s: torch.Tensor
    entropy_u: torch.Tensor
    entropy_s: torch.Tensor
    lse_soft: torch.Tensor     # = lse_s when no rounding was asked for
    x_sample: torch.Tensor     # [R, P] fp32 raw logit of the sampled token
    temperature: torch.Tensor  # [R] T, 1 for greedy rows: s = u / T
    threshold: torch.Tensor | None = None  # [R, P] the filters' smallest kept value (None: no filter)

    def u_of(self, x: torch.Tensor, softcap: float | None) -> torch.Tensor:
        """u of raw logits (e.g. x_sample), the same elementwise map as the pass."""
        return unscaled(x, softcap)

    def logprob_s(self, u_tok: torch.Tensor) -> torch.Tensor:
        """log softmax(s)[tok] from the token's u: its logprob under the row's (scaled) distribution."""
        return u_tok / self.temperature[:, None] - self.lse_s


# ---- keys -----------------------------------------------------------------------------------------

def encode_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """values (compared as fp32), global int64 ids (< 2^32) -> int64 keys ordered by value, then by
    lower id."""
    bits = values.float().contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered << 32) | (_LOW32 - ids)


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (fp32 values, int64 ids)."""
    ordered = keys >> 32
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32), _LOW32 - (keys & _LOW32)


# ---- the torch pass (one piece: the whole local slice) ---------------------------------------------

def torch_partials(x: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                   vocab_start: int, *, softcap: float | None = None, threshold: torch.Tensor | None = None,
                   threshold_on_scaled: bool = True, sampling: bool = True,
                   soft_dtype: torch.dtype | None = None):
    """Partials of one piece (this rank's whole slice): keys [2, R, P, 1], sums [5, R, P, 1]."""
    R, P, V = x.shape
    u = unscaled(x, softcap)
    temp = temperature.view(R, 1, 1).to(u.dtype)
    s = u / effective_temperature(temp)
    if threshold is not None:
        keep = (s if threshold_on_scaled else u) >= threshold.unsqueeze(-1)
        u, s = torch.where(keep, u, -torch.inf), torch.where(keep, s, -torch.inf)
    m = u.amax(-1)
    greedy_key = encode_keys(m, u.argmax(-1) + vocab_start)
    if sampling:
        g = gumbel(seed, counter, P, vocab_start, V)
        noisy = torch.where(torch.isfinite(s), s + g, s)
        sample_key = torch.where(temp[..., 0] > 0, encode_keys(noisy.amax(-1), noisy.argmax(-1) + vocab_start),
                                 greedy_key)
    else:
        sample_key = greedy_key
    # the sums' reference point is the maximum as its key holds it (fp32): pieces then combine from
    # their keys alone, exactly, whatever the logits' precision
    m_key = decode_keys(greedy_key)[0].to(u.dtype)
    m_safe = torch.where(torch.isfinite(m_key), m_key, 0.0).unsqueeze(-1)
    m_s = m_safe / effective_temperature(temp)
    du, ds = u - m_safe, s - m_s
    eu, es = torch.exp(du), torch.exp(ds)
    sums = [row_sum(eu), row_sum(torch.where(eu > 0, eu * du, 0)), row_sum(es), row_sum(torch.where(es > 0, es * ds, 0))]
    if soft_dtype is not None:
        sums.append(row_sum(torch.exp(s.to(soft_dtype).float() - m_s.to(soft_dtype).float())))
    else:
        sums.append(sums[2])
    return torch.stack([greedy_key, sample_key])[..., None], torch.stack(sums)[..., None]


def probabilities(scaled: torch.Tensor, log_norm: torch.Tensor,
                  soft_dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's slice [R, P, V_r] of the globally normalised softmax(scaled), fp32, from the logits
    rounded to `soft_dtype` first (transformers rounds them to the embedding dtype); log_norm [R, P] is
    the matching log-normaliser (VocabStats.lse_soft)."""
    if soft_dtype is not None and soft_dtype != torch.float32:
        scaled = scaled.to(soft_dtype).float()
    return torch.exp(scaled - log_norm.unsqueeze(-1))


def torch_probabilities(x: torch.Tensor, temperature: torch.Tensor, log_norm: torch.Tensor, *,
                        softcap: float | None = None, threshold: torch.Tensor | None = None,
                        threshold_on_scaled: bool = True, soft_dtype: torch.dtype | None = None,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The self-conditioning probabilities softmax(s) of raw logits x [R, P, V_r] (filtered entries 0),
    in `out_dtype` (the embedding's, which the product with the embedding reads)."""
    u = unscaled(x, softcap)
    s = u / effective_temperature(temperature).view(-1, 1, 1).to(u.dtype)
    if threshold is not None:
        s = torch.where((s if threshold_on_scaled else u) >= threshold.unsqueeze(-1), s, -torch.inf)
    return probabilities(s, log_norm, soft_dtype).to(out_dtype)


_TOPK_CHUNK = 1 << 25  # elements of int64 keys built at once for top-k capture


def torch_rank_top_k(x: torch.Tensor, x_tok: torch.Tensor, k: int, vocab_start: int,
                     asked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's part of reveal-time scores for scored rows x [R, P, V_r] whose tokens' raw logits are
    x_tok [R, P]: counts [R, P] of entries with a larger logit (the rank, less 1, once summed over ranks)
    and the k largest keys [R, P, k] (encode_keys of raw logit and global id; padded with keys that lose
    every comparison where the slice is narrower than k), None for k = 0. `asked` [R]: each row's own k
    (-1: no scores), which a kernel may use to skip work; every row is computed here."""
    # x_tok is one of the logits, so it converts back to their dtype exactly
    counts = (x > x_tok.unsqueeze(-1).to(x.dtype)).sum(-1)
    if not k:
        return counts, None
    flat = x.reshape(-1, x.shape[-1])
    ids = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device)
    step = max(1, _TOPK_CHUNK // x.shape[-1])
    keys = torch.cat([encode_keys(flat[i:i + step].float(), ids).topk(min(k, x.shape[-1]), dim=-1).values
                      for i in range(0, flat.shape[0], step)])
    if keys.shape[-1] < k:
        pad = encode_keys(torch.full((1,), -torch.inf, device=x.device), torch.full((1,), _LOW32, device=x.device))
        keys = torch.cat([keys, pad.expand(keys.shape[0], k - keys.shape[-1])], -1)
    return counts, keys.view(*x.shape[:-1], k)


@dataclass(frozen=True)
class VocabPasses:
    """The passes over a rank's logits slice: the statistics' partials, the self-conditioning
    probabilities, the scored rows' rank counts and top-k keys, and the filters' thresholds. Torch's here;
    model.kernels.vocab_stats.TRITON_PASSES on CUDA."""
    partials: Callable = torch_partials
    probabilities: Callable = torch_probabilities
    rank_top_k: Callable = torch_rank_top_k      # scored rows only: a second read of their logits
    threshold: Callable = torch_threshold        # the top-k / top-p filters' thresholds (model/sampling/filters.py)


TORCH_PASSES = VocabPasses()


# ---- combining pieces ------------------------------------------------------------------------------

def combine(keys: torch.Tensor, sums: torch.Tensor, x: torch.Tensor, temperature: torch.Tensor,
            vocab_start: int, tp: TPGroup, soft_dtype: torch.dtype | None = None) -> VocabStats:
    """keys [2, R, P, pieces], sums [5, R, P, pieces] of this rank's pieces; x this rank's raw slice (for
    the sampled token's logit) -> the global statistics, identical on every rank. Two all-reduces."""
    best = tp.all_reduce(keys.amax(-1), dist.ReduceOp.MAX)                    # [2, R, P]
    m, greedy = decode_keys(best[0])
    _, sample = decode_keys(best[1])
    m_piece, _ = decode_keys(keys[0])         # [R, P, pieces]: a piece's greedy key holds its max u
    m, m_piece = m.to(sums.dtype), m_piece.to(sums.dtype)
    temp = effective_temperature(temperature).view(-1, 1, 1).to(sums.dtype)
    m_g = torch.where(torch.isfinite(m), m, 0.0).unsqueeze(-1)
    # a piece with every entry filtered sums zeros: scaled by 1, not by exp(0 - max / T), which overflows
    # for max / T < -88 (and inf * 0 is NaN)
    m_p = torch.where(torch.isfinite(m_piece), m_piece, m_g)
    # a piece's maximum of s is its maximum of u divided by T (division is monotone): what the pass used
    ms_g, ms_p = m_g / temp, m_p / temp
    scale_u, scale_s = torch.exp(m_p - m_g), torch.exp(ms_p - ms_g)
    z_u = row_sum(sums[0] * scale_u)
    a_u = row_sum((sums[1] + sums[0] * (m_p - m_g)) * scale_u)
    z_s = row_sum(sums[2] * scale_s)
    a_s = row_sum((sums[3] + sums[2] * (ms_p - ms_g)) * scale_s)
    if soft_dtype is not None:
        r_g, r_p = ms_g.to(soft_dtype).float(), ms_p.to(soft_dtype).float()
        z_soft = row_sum(sums[4] * torch.exp(r_p - r_g))
    else:
        r_g, z_soft = ms_g, z_s
    x_sample = _value_at(x, sample, vocab_start)
    total = tp.all_reduce(torch.stack([z_u, a_u, z_s, a_s, z_soft, x_sample]))
    z_u, a_u, z_s, a_s, z_soft, x_sample = total
    lse_u = m + torch.log(z_u)
    lse_s = ms_g[..., 0] + torch.log(z_s)
    return VocabStats(greedy=greedy, sample=sample, max_u=m, lse_u=lse_u, lse_s=lse_s,
                      entropy_u=torch.log(z_u) - a_u / z_u, entropy_s=torch.log(z_s) - a_s / z_s,
                      lse_soft=r_g[..., 0] + torch.log(z_soft) if soft_dtype is not None else lse_s,
                      x_sample=x_sample, temperature=temp.view(-1))


def _value_at(x: torch.Tensor, ids: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """x[..., ids] as fp32 where this rank holds the id, 0 elsewhere (a SUM over ranks picks the owner's)."""
    local = ids - vocab_start
    mine = (local >= 0) & (local < x.shape[-1])
    picked = upcast(torch.gather(x, -1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1))
    return torch.where(mine, picked, 0.0)


def value_at(x: torch.Tensor, ids: torch.Tensor, vocab_start: int, tp: TPGroup) -> torch.Tensor:
    """The raw logit x[..., id] of global ids, as fp32, identical on every rank (one SUM all-reduce)."""
    return tp.all_reduce(_value_at(x, ids, vocab_start))


def vocab_stats(x: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                vocab_start: int, tp: TPGroup, *, softcap: float | None = None,
                threshold: torch.Tensor | None = None, threshold_on_scaled: bool = True, sampling: bool = True,
                soft_dtype: torch.dtype | None = None, passes: VocabPasses = TORCH_PASSES) -> VocabStats:
    """The statistics of x [R, P, V_r] (this rank's raw logits), from `passes`' partials."""
    keys, sums = passes.partials(x, temperature, seed, counter, vocab_start, softcap=softcap, threshold=threshold,
                          threshold_on_scaled=threshold_on_scaled, sampling=sampling, soft_dtype=soft_dtype)
    stats = combine(keys, sums, x, temperature, vocab_start, tp, soft_dtype)
    stats.threshold = threshold
    return stats
