"""The sampler's passes over the vocabulary in triton (CUDA), `TRITON_PASSES`: model.sampling.stats'
partials in one read of each rank's logits slice, the self-conditioning probabilities in one read and
one write, and the scored rows' rank counts and top-k keys in one read.

One program per (position, split of the slice) keeps online maxima as order-preserving keys and five
sums of exponentials; the softcap, threshold, temperature and Gumbel noise are applied in registers and
rounded as torch rounds them (an IEEE division, the softcap's reciprocal from the host). Splits depend on
the slice width alone, so a row's statistics do not depend on its neighbours. Design: docs/kernels.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.filters import capped, softcap_operands, triton_threshold
from model.kernels.launch import INTERPRETED
from model.sampling.noise import STREAM_GUMBEL
from model.sampling.stats import NUM_SUMS, VocabPasses, encode_keys

BLOCK = 2048
SPLIT = 16384          # vocabulary entries per program: 8 splits of a 131072 slice
_ROUNDED = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h = h * 0x85EBCA6B
    h ^= h >> 13
    h = h * 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _keys(values, ids):
    bits = values.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - ids)


@triton.jit
def _round(v, ROUNDED: tl.constexpr):
    """v rounded to the embedding dtype (to nearest, ties to even, as torch's casts), back in fp32."""
    if ROUNDED == 1:  # bf16 by integer rounding of the fp32 bits: exact, here and in the interpreter
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = bits.to(tl.float32, bitcast=True)
    elif ROUNDED == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _vocab_stats_kernel(x_ptr, temp_ptr, seed_ptr, counter_ptr, thr_ptr, keys_ptr, sums_ptr,
                        P, V, vocab_start, splits, n_total, softcap, inv_softcap,
                        STREAM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_THR: tl.constexpr,
                        THR_ON_SCALED: tl.constexpr, SAMPLING: tl.constexpr, ROUNDED: tl.constexpr,
                        INTERPRETED: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    n = tl.program_id(0)
    split = tl.program_id(1)
    row = n // P
    pos = n % P
    temp = tl.load(temp_ptr + row)
    t_eff = tl.where(temp > 0, temp, 1.0)
    if HAS_THR:
        thr = tl.load(thr_ptr + n)
    if SAMPLING:
        seed = tl.load(seed_ptr + row)
        counter = tl.load(counter_ptr + row)
        k = _fmix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ ((STREAM * 0x9E3779B9) & 0xFFFFFFFF))
        k = _fmix32(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        k = _fmix32(k ^ (counter & 0xFFFFFFFF).to(tl.uint32))
        h_pos = _fmix32(k ^ pos.to(tl.uint32))
    row_ptr = x_ptr + n.to(tl.int64) * V
    start = split * SPLIT_SIZE
    m = -float("inf")
    z_u = 0.0
    a_u = 0.0
    z_s = 0.0
    a_s = 0.0
    z_r = 0.0
    greedy = tl.full((), -9223372036854775807 - 1, tl.int64)
    sample = tl.full((), -9223372036854775807 - 1, tl.int64)
    for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
        cols = start + off + tl.arange(0, BLOCK_SIZE)
        inside = cols < V
        u = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
        if HAS_SOFTCAP:
            u = tl.where(inside, capped(u, softcap, inv_softcap, INTERPRETED), u)
        s = tl.div_rn(u, t_eff)
        if HAS_THR:
            if THR_ON_SCALED:
                keep = s >= thr
            else:
                keep = u >= thr
            u = tl.where(keep, u, -float("inf"))
            s = tl.where(keep, s, -float("inf"))
        ids = (vocab_start + cols).to(tl.int64)
        greedy = tl.maximum(greedy, tl.max(_keys(u, ids), axis=0))
        if SAMPLING:
            if temp > 0:   # a greedy row's sample is its argmax: no noise drawn (a graph's plan samples always)
                h = _fmix32(h_pos ^ _fmix32(ids.to(tl.uint32)))
                unif = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                noisy = tl.where(s > -float("inf"), s - tl.log(-tl.log(unif)), s)
                sample = tl.maximum(sample, tl.max(_keys(noisy, ids), axis=0))
        new_m = tl.maximum(m, tl.max(u, axis=0))
        new_safe = tl.where(new_m == -float("inf"), 0.0, new_m)
        # nothing summed yet: no rescale (from 0, exp(-max / T) overflows for max / T < -88: inf * 0 = NaN)
        old_safe = tl.where(m == -float("inf"), new_safe, m)
        # rescale what the earlier tiles summed to the new maximum
        d = old_safe - new_safe
        alpha = tl.exp(d)
        a_u = alpha * (a_u + z_u * d)
        z_u = alpha * z_u
        ms_old = tl.div_rn(old_safe, t_eff)
        ms_new = tl.div_rn(new_safe, t_eff)
        ds = ms_old - ms_new
        alpha_s = tl.exp(ds)
        a_s = alpha_s * (a_s + z_s * ds)
        z_s = alpha_s * z_s
        r_new = _round(ms_new, ROUNDED)
        z_r = tl.exp(_round(ms_old, ROUNDED) - r_new) * z_r
        du = u - new_safe
        eu = tl.exp(du)
        z_u += tl.sum(eu, axis=0)
        a_u += tl.sum(tl.where(eu > 0, eu * du, 0.0), axis=0)
        dsv = s - ms_new
        es = tl.exp(dsv)
        z_s += tl.sum(es, axis=0)
        a_s += tl.sum(tl.where(es > 0, es * dsv, 0.0), axis=0)
        if ROUNDED != 0:
            z_r += tl.sum(tl.exp(_round(s, ROUNDED) - r_new), axis=0)
        m = new_m
    if ROUNDED == 0:
        z_r = z_s
    if SAMPLING:
        sample = tl.where(temp > 0, sample, greedy)
    else:
        sample = greedy
    out = n * splits + split
    tl.store(keys_ptr + out, greedy)
    tl.store(keys_ptr + n_total * splits + out, sample)
    tl.store(sums_ptr + out, z_u)
    tl.store(sums_ptr + n_total * splits + out, a_u)
    tl.store(sums_ptr + 2 * n_total * splits + out, z_s)
    tl.store(sums_ptr + 3 * n_total * splits + out, a_s)
    tl.store(sums_ptr + 4 * n_total * splits + out, z_r)


def triton_partials(x: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                    vocab_start: int, *, softcap: float | None = None, threshold: torch.Tensor | None = None,
                    threshold_on_scaled: bool = True, sampling: bool = True,
                    soft_dtype: torch.dtype | None = None):
    """model.sampling.stats.torch_partials' contract, split into ceil(V_r / SPLIT) pieces per position:
    keys [2, R, P, splits] int64, sums [5, R, P, splits] fp32."""
    R, P, V = x.shape
    x = x.contiguous()
    splits = triton.cdiv(V, SPLIT)
    n_total = R * P
    keys = torch.empty(2, R, P, splits, dtype=torch.int64, device=x.device)
    sums = torch.empty(NUM_SUMS, R, P, splits, dtype=torch.float32, device=x.device)
    temp = temperature.float().contiguous()
    thr = threshold.float().contiguous() if threshold is not None else temp
    _vocab_stats_kernel[(n_total, splits)](
        x, temp, seed.contiguous(), counter.contiguous(), thr, keys, sums, P, V, vocab_start, splits, n_total,
        *softcap_operands(softcap), STREAM=STREAM_GUMBEL, HAS_SOFTCAP=softcap is not None,
        HAS_THR=threshold is not None, THR_ON_SCALED=threshold_on_scaled, SAMPLING=sampling,
        ROUNDED=_ROUNDED[soft_dtype], INTERPRETED=INTERPRETED,
        SPLIT_SIZE=min(SPLIT, triton.next_power_of_2(V)), BLOCK_SIZE=min(BLOCK, triton.next_power_of_2(V)),
        num_warps=8)
    return keys, sums


@triton.jit
def _probabilities_kernel(x_ptr, temp_ptr, thr_ptr, norm_ptr, out_ptr, P, V, softcap, inv_softcap,
                          HAS_SOFTCAP: tl.constexpr, HAS_THR: tl.constexpr, THR_ON_SCALED: tl.constexpr,
                          ROUNDED: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = cols < V
    temp = tl.load(temp_ptr + n // P)
    t_eff = tl.where(temp > 0, temp, 1.0)
    log_norm = tl.load(norm_ptr + n)
    offset = n.to(tl.int64) * V
    u = tl.load(x_ptr + offset + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        u = capped(u, softcap, inv_softcap, INTERPRETED)
    s = tl.div_rn(u, t_eff)
    if HAS_THR:
        thr = tl.load(thr_ptr + n)
        if THR_ON_SCALED:
            s = tl.where(s >= thr, s, -float("inf"))
        else:
            s = tl.where(u >= thr, s, -float("inf"))
    p = tl.exp(_round(s, ROUNDED) - log_norm)
    tl.store(out_ptr + offset + cols, p.to(out_ptr.dtype.element_ty), mask=inside)


def triton_probabilities(x: torch.Tensor, temperature: torch.Tensor, log_norm: torch.Tensor, *,
                         softcap: float | None = None, threshold: torch.Tensor | None = None,
                         threshold_on_scaled: bool = True, soft_dtype: torch.dtype | None = None,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """model.sampling.stats.torch_probabilities' contract."""
    R, P, V = x.shape
    x = x.contiguous()
    out = torch.empty(R, P, V, dtype=out_dtype, device=x.device)
    temp = temperature.float().contiguous()
    thr = threshold.float().contiguous() if threshold is not None else temp
    block = min(BLOCK, triton.next_power_of_2(V))
    _probabilities_kernel[(R * P, triton.cdiv(V, block))](
        x, temp, thr, log_norm.float().contiguous(), out, P, V, *softcap_operands(softcap),
        HAS_SOFTCAP=softcap is not None, HAS_THR=threshold is not None, THR_ON_SCALED=threshold_on_scaled,
        ROUNDED=_ROUNDED[soft_dtype], INTERPRETED=INTERPRETED, BLOCK_SIZE=block, num_warps=4)
    return out


@triton.jit
def _rank_top_kernel(x_ptr, tok_ptr, asked_ptr, counts_ptr, keys_ptr, P, V, vocab_start, splits, pad_key,
                     TOP: tl.constexpr, KP: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    n = tl.program_id(0)
    split = tl.program_id(1)
    asked = tl.load(asked_ptr + n // P)   # the row's own k; -1: no scores (a graph's plan scores every row)
    row_ptr = x_ptr + n.to(tl.int64) * V
    tok = tl.load(tok_ptr + n).to(tl.float32)
    start = split * SPLIT_SIZE
    count = tl.zeros((), dtype=tl.int32)
    lowest = tl.full((), -9223372036854775807 - 1, tl.int64)
    best = tl.full((KP,), -9223372036854775807 - 1, tl.int64)
    heads = tl.arange(0, BLOCK_SIZE // KP)
    pair = tl.arange(0, 2)
    if asked >= 0:
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = start + off + tl.arange(0, BLOCK_SIZE)
            inside = cols < V
            x = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
            count += tl.sum((x > tok).to(tl.int32), 0)
            if TOP:
                if asked > 0:   # this tile's KP largest keys, merged with the split's so far (sorted, take the head)
                    keys = tl.where(inside, _keys(x, (vocab_start + cols).to(tl.int64)), pad_key)
                    tile = tl.reshape(tl.sort(keys, descending=True), (BLOCK_SIZE // KP, KP))
                    head = tl.max(tl.where(heads[:, None] == 0, tile, lowest), 0)
                    both = tl.reshape(tl.sort(tl.cat(best, head, can_reorder=True), descending=True), (2, KP))
                    best = tl.max(tl.where(pair[:, None] == 0, both, lowest), 0)
    out = n * splits + split
    tl.store(counts_ptr + out, count)
    if TOP:
        tl.store(keys_ptr + out * KP + tl.arange(0, KP), best)


def triton_rank_top_k(x: torch.Tensor, x_tok: torch.Tensor, k: int, vocab_start: int,
                      asked: torch.Tensor | None = None, *, block: int = BLOCK, split: int = SPLIT):
    """model.sampling.stats.torch_rank_top_k's contract: one read of the scored rows' logits for both
    the rank counts and the top k keys (per split: its KP largest by sort-and-merge, then the splits'
    merged here). Rows whose `asked` k is -1 are skipped, those asking 0 get only their rank counts.
    block, split: the tile and split widths (powers of two; smaller ones only in tests)."""
    R, P, V = x.shape
    x = x.contiguous()
    if asked is None:
        asked = torch.full((R,), k, dtype=torch.int64, device=x.device)
    kp = max(triton.next_power_of_2(max(k, 1)), 2)
    block = max(min(block, triton.next_power_of_2(V)), kp)
    split = max(min(split, triton.next_power_of_2(V)), block)
    splits = triton.cdiv(V, split)
    counts = torch.empty(R, P, splits, dtype=torch.int32, device=x.device)
    keys = torch.empty(R, P, splits, kp, dtype=torch.int64, device=x.device)
    pad = int(encode_keys(torch.full((1,), -torch.inf), torch.full((1,), (1 << 32) - 1, dtype=torch.int64)))
    _rank_top_kernel[(R * P, splits)](
        x, x_tok.float().contiguous(), asked.contiguous(), counts, keys, P, V, vocab_start, splits, pad, TOP=k > 0,
        KP=kp, SPLIT_SIZE=split, BLOCK_SIZE=block, num_warps=8)
    top = keys.flatten(-2).topk(k, dim=-1).values if k else None
    return counts.sum(-1, dtype=torch.int64), top


TRITON_PASSES = VocabPasses(partials=triton_partials, probabilities=triton_probabilities,
                            rank_top_k=triton_rank_top_k, threshold=triton_threshold)
