"""The per-head chains between the qkv projection and attention, one triton kernel per layer:

    Gemma-4      q' = rope(rms(q) * w_q),   k' = rope(rms(k) * w_k),   v' = rms(v)    (qkv_norm_rope)
    Ministral-3  q' = rope(q) * s(pos),     k' = rope(k)                                (qk_rope)

per (token, head) row. Given a layer's KVRows (model.attention.kv_rows), the kernel also stores k'
and v' (Ministral: v as it is) into the cache rows of the step's tokens, so no index_copy follows it.
rms(x) = x (mean(x^2) + eps)^-1/2 in fp32, rounded to the model dtype before RoPE (transformers'
order); RoPE and the query scale in fp32 and rounded once, as inductor's fused chains did. One program
per (token, head): each row's sum of squares is its own, so the result never depends on the batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from model.attention import KVRows


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, scale, out_ptr, cache_ptr, eps, HALF: tl.constexpr,
                   NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, OUT: tl.constexpr,
                   CACHE: tl.constexpr):
    d = tl.arange(0, HALF)
    y1 = tl.load(x_ptr + d).to(tl.float32)
    y2 = tl.load(x_ptr + HALF + d).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        mean_square = (tl.sum(y1 * y1, 0) + tl.sum(y2 * y2, 0)) / (2 * HALF)
        r = 1.0 / tl.sqrt(mean_square + eps)
        y1, y2 = y1 * r, y2 * r
        if HAS_WEIGHT:
            y1 = y1 * tl.load(w_ptr + d).to(tl.float32)
            y2 = y2 * tl.load(w_ptr + HALF + d).to(tl.float32)
        if ROPE:   # the norm's output dtype
            y1, y2 = y1.to(dtype).to(tl.float32), y2.to(dtype).to(tl.float32)
    if ROPE:
        c1 = tl.load(cos_ptr + d).to(tl.float32)
        c2 = tl.load(cos_ptr + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + d).to(tl.float32)
        s2 = tl.load(sin_ptr + HALF + d).to(tl.float32)
        y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2                       # x cos + rotate_half(x) sin
    y1, y2 = (y1 * scale).to(dtype), (y2 * scale).to(dtype)
    if OUT:
        tl.store(out_ptr + d, y1)
        tl.store(out_ptr + HALF + d, y2)
    if CACHE:
        tl.store(cache_ptr + d, y1)
        tl.store(cache_ptr + HALF + d, y2)


@triton.jit
def _qkv_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_scale_ptr, qo_ptr, ko_ptr, vo_ptr,
                ck_ptr, cv_ptr, write_ptr, HQ, HKV, sq_tok, sk_tok, sv_tok, sc_tok, eps, HALF: tl.constexpr,
                NORM: tl.constexpr, Q_SCALE: tl.constexpr, CACHE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    D = 2 * HALF
    cos, sin = cos_ptr + tok * sc_tok, sin_ptr + tok * sc_tok
    row = tl.load(write_ptr + tok).to(tl.int64) if CACHE else tok      # the token's cache row
    if h < HQ:
        scale = tl.load(q_scale_ptr + tok).to(tl.float32) if Q_SCALE else 1.0
        _norm_rope_row(q_ptr + tok * sq_tok + h * D, qw_ptr, cos, sin, scale, qo_ptr + (tok * HQ + h) * D, qo_ptr,
                       eps, HALF, NORM, NORM, True, True, False)
    elif h < HQ + HKV:
        j = h - HQ
        _norm_rope_row(k_ptr + tok * sk_tok + j * D, kw_ptr, cos, sin, 1.0, ko_ptr + (tok * HKV + j) * D,
                       ck_ptr + (row * HKV + j) * D, eps, HALF, NORM, NORM, True, True, CACHE)
    else:   # v: its norm (unscaled, no RoPE) with NORM, else only its copy into the cache
        j = h - HQ - HKV
        _norm_rope_row(v_ptr + tok * sv_tok + j * D, kw_ptr, cos, sin, 1.0, vo_ptr + (tok * HKV + j) * D,
                       cv_ptr + (row * HKV + j) * D, eps, HALF, NORM, False, False, NORM, CACHE)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] -> [B * L, H * D]: a strided view when the heads are packed and the tokens evenly
    spaced (a split of the qkv projection; a dimension of size 1, as in a one-token AR step, may have
    any stride), else a packed copy."""
    b, n, h, d = x.shape
    packed = x.stride(3) == 1 and (h == 1 or x.stride(2) == d)
    if not packed or not (b == 1 or n == 1 or x.stride(0) == n * x.stride(1)):
        x = x.contiguous()
    return x.as_strided((b * n, h * d), (x.stride(1) if n > 1 else x.stride(0), 1))


def qkv_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  cache: KVRows | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gemma-4: q [B, L, Hq, D], k and v [B, L, Hkv, D] (v may be k: K = V), cos/sin [B, L, 1, D] -> new
    contiguous q', k', v' in q's dtype; k' and v' also stored into `cache`'s rows."""
    b, n, hq, d = q.shape
    qo, ko, vo = (torch.empty(b, n, t.shape[2], d, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _launch(q, k, v, q_weight, k_weight, eps, cos, sin, None, qo, ko, vo, cache, norm=True)
    return qo, ko, vo


def qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_scale: torch.Tensor | None,
            v: torch.Tensor | None = None, cache: KVRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ministral-3: RoPE of q [B, L, Hq, D] and k [B, L, Hkv, D], then q times the Llama-4 query scale
    q_scale [B, L, 1, 1] (None: 1) -> new contiguous q', k'; with `cache`, k' and v [B, L, Hkv, D] also
    stored into its rows."""
    assert cache is None or v is not None, "storing into the cache needs v"
    b, n, hq, d = q.shape
    qo, ko = (torch.empty(b, n, t.shape[2], d, dtype=t.dtype, device=t.device) for t in (q, k))
    _launch(q, k, k if v is None else v, None, None, 0.0, cos, sin, q_scale, qo, ko, ko, cache, norm=False)
    return qo, ko


def _launch(q, k, v, q_weight, k_weight, eps, cos, sin, q_scale, qo, ko, vo, cache, norm: bool) -> None:
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    rows = [_token_rows(t) for t in (q, k, v)]
    trig = [t.reshape(b * n, d) for t in (cos, sin)]
    scale = q if q_scale is None else q_scale.reshape(b * n)       # q: a pointer never read
    weights = (q, q) if q_weight is None else (q_weight, k_weight)
    if cache is not None:
        assert cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.shape[1:] == (hkv, d)
        assert cache.index.numel() == b * n, "one cache row per token"
    destination = (cache.k, cache.v, cache.index) if cache is not None else (q, q, q)   # q: never read
    heads = hq + (2 if norm or cache is not None else 1) * hkv
    _qkv_kernel[(b * n, heads)](
        *rows, *weights, *trig, scale, qo, ko, vo, *destination, hq, hkv, rows[0].stride(0), rows[1].stride(0),
        rows[2].stride(0), trig[0].stride(0), eps, HALF=d // 2, NORM=norm, Q_SCALE=q_scale is not None,
        CACHE=cache is not None, num_warps=1 if d <= 256 else 2)
