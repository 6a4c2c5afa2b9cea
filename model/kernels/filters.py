"""The top-k / top-p filters' thresholds in triton (CUDA): model.sampling.filters' radix select, over
the raw logits' order-preserving keys.

The values filters are decided on, v = softcap(x) (DiffusionGemma) or x / T (masked diffusion), are a
non-decreasing function of the raw logit x, so the k-th largest v is v(the k-th largest x), and the
largest v-threshold reaching a top-p mass is v(the largest x-threshold reaching it). The search can
therefore run over the keys of x in its own precision: 16 bits for bf16 logits (four passes of four
bits), 32 otherwise. Each pass is one kernel: per (row position, split of the vocabulary slice), the
count (top-k) or probability mass (top-p, relative to a log-normaliser pass) of the entries at or
above 16 candidate keys. Rows that ask for neither filter skip every pass. The threshold handed on is
v(x_t), computed by `decided_value`, the same code the statistics kernels (model/kernels/vocab_stats.py)
apply to every entry, so the entry x_t itself always passes its own threshold.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from model.kernels.launch import INTERPRETED
from model.parallel.group import TPGroup
from model.sampling.filters import CANDIDATES, key_values, radix_select

BLOCK = 1024
SPLIT = 16384
COUNT, LOG_NORM, MASS = 0, 1, 2


@triton.jit
def tanh(y, INTERPRETED: tl.constexpr):
    """tanh in fp32: libdevice's on the GPU; in the interpreter, to a few ulps, its odd Taylor polynomial
    near 0 and (1 - e^-2|y|) / (1 + e^-2|y|) elsewhere."""
    if not INTERPRETED:
        return libdevice.tanh(y)
    a = tl.abs(y)
    y2 = y * y
    near = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.0625, near, tl.where(y < 0, -far, far))


@triton.jit
def decided_value(x, t_eff, softcap, HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """The value a filter is decided on, of raw logits x (fp32): softcap(x) [/ T]."""
    u = x
    if HAS_SOFTCAP:
        u = tanh(u / softcap, INTERPRETED) * softcap
    if ON_SCALED:
        u = u / t_eff
    return u


@triton.jit
def _logit_keys(x, BITS: tl.constexpr):
    """Order-preserving int64 keys of fp32 x in the logits' own BITS-bit precision (bf16 values in fp32
    are their 16 bits shifted up), -0 as +0."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) >> (32 - BITS)
    return tl.where(ordered == -1, 0, ordered)


@triton.jit
def _filter_pass_kernel(x_ptr, temp_ptr, active_ptr, prefix_ptr, thr_ptr, norm_ptr, out_ptr,
                        P, V, splits, shift, softcap,
                        MODE: tl.constexpr, BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        ON_SCALED: tl.constexpr, INTERPRETED: tl.constexpr, NC: tl.constexpr,
                        SPLIT_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """MODE COUNT: out[n, split, d] = entries with key >= prefix[n] + d << shift;
    LOG_NORM: out[n, split, 0:2] = (max, sum exp(v - max)) of the top-k survivors' values;
    MASS: out[n, split, d] = their probability mass (exp(v - norm[n])) at keys >= prefix[n] + d << shift."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    row = n // P
    active = tl.load(active_ptr + row)
    d = tl.arange(0, NC)
    acc = tl.zeros((NC,), dtype=tl.float32)
    m = tl.full((), -float("inf"), tl.float32)
    z = tl.zeros((), tl.float32)
    if active != 0:
        temp = tl.load(temp_ptr + row)
        t_eff = tl.where(temp > 0, temp, 1.0)
        candidates = tl.load(prefix_ptr + n) + (d.to(tl.int64) << shift)
        if MODE != COUNT:
            thr = decided_value(tl.load(thr_ptr + n), t_eff, softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
        if MODE == MASS:
            norm = tl.load(norm_ptr + n)
        row_ptr = x_ptr + n.to(tl.int64) * V
        start = split * SPLIT_SIZE
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = start + off + tl.arange(0, BLOCK_SIZE)
            inside = cols < V
            x = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
            if MODE == COUNT:
                keys = _logit_keys(x, BITS)
                at = (keys[:, None] >= candidates[None, :]) & inside[:, None]
                acc += tl.sum(at.to(tl.float32), 0)
            else:
                v = decided_value(x, t_eff, softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
                v = tl.where(inside & (v >= thr), v, -float("inf"))
                if MODE == LOG_NORM:
                    new_m = tl.maximum(m, tl.max(v, 0))
                    safe = tl.where(new_m == -float("inf"), 0.0, new_m)
                    z = z * tl.exp(tl.where(m == -float("inf"), -float("inf"), m - safe)) + tl.sum(tl.exp(v - safe), 0)
                    m = new_m
                else:
                    p = tl.exp(v - norm)
                    keys = _logit_keys(x, BITS)
                    acc += tl.sum(tl.where(keys[:, None] >= candidates[None, :], p[:, None], 0.0), 0)
    out = (n * splits + split) * NC
    if MODE == LOG_NORM:
        tl.store(out_ptr + out + d, tl.where(d == 0, m, tl.where(d == 1, z, 0.0)))
    else:
        tl.store(out_ptr + out + d, acc)


@triton.jit
def _finish_kernel(x_ptr, temp_ptr, out_ptr, P, softcap, HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """out[n] = v(x[n]) (-inf stays -inf): a threshold in the space the filters are decided in."""
    n = tl.program_id(0)
    temp = tl.load(temp_ptr + n // P)
    t_eff = tl.where(temp > 0, temp, 1.0)
    x = tl.load(x_ptr + n)
    v = decided_value(x, t_eff, softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
    tl.store(out_ptr + n, tl.where(x == -float("inf"), -float("inf"), v))


def triton_threshold(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     vocab_start: int, tp: TPGroup, *, softcap: float | None = None,
                     on_scaled: bool = True) -> torch.Tensor:
    """model.sampling.filters.torch_threshold's contract on CUDA (and the interpreter)."""
    R, P, V = x.shape
    x = x.contiguous()
    bits = 16 if x.dtype == torch.bfloat16 else 32
    splits = triton.cdiv(V, SPLIT)
    temp = temperature.float().contiguous()
    kw = dict(HAS_SOFTCAP=softcap is not None, ON_SCALED=on_scaled, INTERPRETED=INTERPRETED)
    cap = float(softcap or 1.0)

    def run(mode, active, prefix, thr, norm, shift=0):
        out = torch.empty(R * P, splits, CANDIDATES, dtype=torch.float32, device=x.device)
        _filter_pass_kernel[(R * P, splits)](x, temp, active, prefix, thr, norm, out, P, V, splits, shift, cap,
                                             MODE=mode, BITS=bits, NC=CANDIDATES, SPLIT_SIZE=min(SPLIT, V),
                                             BLOCK_SIZE=min(BLOCK, triton.next_power_of_2(V)), num_warps=4, **kw)
        return out

    none = torch.full((R * P,), -torch.inf, device=x.device)
    dummy = torch.zeros(R * P, dtype=torch.int64, device=x.device)

    def totals(active, thr, norm, mode):
        def at_least(candidates, shift):
            prefix = candidates[..., 0].reshape(-1).contiguous()
            return run(mode, active, prefix, thr, norm, shift).sum(1, dtype=torch.float64).view(R, P, CANDIDATES)
        return at_least

    # top-k: the k-th largest logit's key (rows asking none, or more than the vocabulary, keep all)
    k_active = (top_k > 0).to(torch.int32).contiguous()
    target = top_k.clamp(min=1).to(torch.float64).view(R, 1).expand(R, P)
    key_k, reached_k = radix_select(totals(k_active, none, none, COUNT), target, bits, (R, P), tp, x.device)
    x_k = torch.where((top_k > 0).view(R, 1) & reached_k, _key_logits(key_k, bits), -torch.inf).reshape(-1).contiguous()
    # top-p over the top-k survivors: their log-normaliser, then the mass search
    p_active = (top_p < 1).to(torch.int32).contiguous()
    parts = run(LOG_NORM, p_active, dummy, x_k, none)[..., :2]                      # [R*P, splits, 2]
    m_local = parts[..., 0].amax(1)
    m = tp.all_reduce(m_local, torch.distributed.ReduceOp.MAX)
    safe = torch.where(torch.isfinite(m), m, 0.0)
    z = tp.all_reduce((parts[..., 1] * torch.exp(parts[..., 0] - safe[:, None])).nan_to_num(0.0).sum(1))
    norm = (safe + torch.log(z)).contiguous()
    target = top_p.to(torch.float64).view(R, 1).expand(R, P)
    key_p, reached_p = radix_select(totals(p_active, x_k, norm, MASS), target, bits, (R, P), tp, x.device)
    x_p = torch.where((top_p < 1).view(R, 1) & reached_p, _key_logits(key_p, bits), -torch.inf).reshape(-1)
    raw = torch.maximum(x_k, x_p).contiguous()
    out = torch.empty(R * P, dtype=torch.float32, device=x.device)
    _finish_kernel[(R * P,)](raw, temp, out, P, cap, **kw)
    return out.view(R, P)


def _key_logits(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """The fp32 logit of each key of _logit_keys (bf16 keys widen exactly)."""
    return key_values(keys, torch.bfloat16 if bits == 16 else torch.float32).float()
