"""FP8-dynamic activations quantized per row in the kernel that produces them (model/fp8.py's rounding):
one program per row reads the row once, computes its producer (a residual add and RMS norm, Gemma's
norm, a gated activation, or nothing), then the row's scale and its FP8 values:

    scale = max(absmax(y) / 448, 1 / (448 * 512)),   q = fp8(clamp(y / scale, +-448))   (IEEE division)

A row's result depends on that row alone (batch-invariant). Rows up to MAX_ROW wide; model.fused keeps
inductor's chain beyond. Why a row a program: docs/kernels.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.fp8 import FP8_MAX, MIN_SCALE

MAX_ROW = 16384
_FP8_MAX, _MIN_SCALE = tl.constexpr(FP8_MAX), tl.constexpr(MIN_SCALE)   # model/fp8.py's, in the kernel
NORMS = {None: 0, "ministral": 1, "gemma": 2}
GATES = {None: 0, "silu": 1, "gelu": 2}


@triton.jit
def _quantize_kernel(x_ptr, x_stride, r_ptr, r_stride, h_ptr, w_ptr, q_ptr, s_ptr, K, eps,
                     RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < K
    x_row = x_ptr + row * x_stride
    dtype = x_ptr.dtype.element_ty
    # every 16-bit product below is taken in fp32 and rounded back to x's dtype where the unfused function
    # rounds (torch computes a bf16 op in fp32 and rounds its result); divisions IEEE-rounded, as torch's
    if GATE != 0:
        gate = tl.load(x_row + cols, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + cols, mask=keep, other=0.0).to(tl.float32)
        if GATE == 1:
            act = tl.div_rn(gate, 1.0 + tl.exp(-gate))
        else:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)   # sqrt(2 / pi) (...)
            act = 0.5 * gate * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)))   # tanh by exp
        y = (act.to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
    else:
        y = tl.load(x_row + cols, mask=keep, other=0.0).to(tl.float32)
        if RESIDUAL:
            r = tl.load(r_ptr + row * r_stride + cols, mask=keep, other=0.0).to(tl.float32)
            h = (y + r).to(dtype)
            tl.store(h_ptr + row * K + cols, h, mask=keep)
            y = h.to(tl.float32)
        if NORM != 0:
            inv = tl.rsqrt(tl.div_rn(tl.sum(y * y, axis=0), K * 1.0) + eps)
            w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
            if NORM == 1:   # Ministral-3: normalised, rounded, then times the weight (a 16-bit product)
                y = ((y * inv).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            else:           # Gemma: normalised and weighted in fp32, rounded once
                y = (y * inv * w).to(dtype).to(tl.float32)
    y = tl.where(keep, y, 0.0)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), axis=0), _FP8_MAX), _MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.div_rn(y, scale), -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=keep)
    tl.store(s_ptr + row, scale)


def takes(x: torch.Tensor, width: int) -> bool:
    """Whether the kernel takes rows x of `width` outputs: CUDA (or the interpreter), 16-bit, not too wide,
    contiguous along the row."""
    return x.dtype in (torch.bfloat16, torch.float16) and width <= MAX_ROW and x.stride(-1) == 1


def quantize(x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
             eps: float = 0.0, norm: str | None = None, gate: str | None = None,
             q_dtype: torch.dtype = torch.float8_e4m3fn):
    """x [rows, K] (gated: [rows, 2K]) -> (q [rows, K] float8_e4m3fn, scale [rows] fp32), with h = x +
    residual [rows, K] first when given (returned first: (h, q, scale)). q_dtype=torch.float32 returns the
    clamped quotients before their rounding to FP8: the CPU tests' view, since triton's interpreter rounds
    fp32 to FP8 wrongly (it truncates subnormals and drops some carries into the exponent; triton 3.6)."""
    rows = x.shape[0]
    k = x.shape[1] // 2 if gate else x.shape[1]
    assert x.dim() == 2 and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    assert (norm is None) == (weight is None) and not (gate and (norm or residual is not None))
    q = torch.empty(rows, k, dtype=q_dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    h = torch.empty(rows, k, dtype=x.dtype, device=x.device) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(k)
        _quantize_kernel[(rows,)](
            x, x.stride(0), residual if residual is not None else x, residual.stride(0) if residual is not None else 0,
            h if h is not None else x, weight if weight is not None else x, q, scale, k, float(eps),
            RESIDUAL=residual is not None, NORM=NORMS[norm], GATE=GATES[gate], BLOCK=block,
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return (h, q, scale) if residual is not None else (q, scale)

