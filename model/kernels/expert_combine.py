"""The experts' outputs back to their tokens, weighted and summed, in one triton kernel:

    out[t] = sum_j  w[t, j] * y[slot[t, j]]        j = 0 .. k-1 in order, in fp32, rounded once

y holds the (token, expert) pairs' outputs sorted by expert, slot[t, j] where token t's j-th pair went.
The kernel reads them where they lie, where torch needs a scatter back to token order and a batched
weighted sum. Each token's sum is its own, in a fixed order: batch-invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.launch import INTERPRETED

BLOCK = 512


@triton.jit
def _expert_combine_kernel(y_ptr, slot_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr,
                           INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(slot_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += w * tl.load(y_ptr + row * H + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=keep)


def combine(y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T * k, H] of the sorted pairs, slot [T * k] (pair t * k + j -> its row of y), weights [T, k] ->
    [T, H] in y's dtype."""
    t, k = weights.shape
    h = y.shape[-1]
    y = y.contiguous()
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    _expert_combine_kernel[(t, triton.cdiv(h, BLOCK))](y, slot, weights.contiguous(), out, h, K=k, BLOCK=BLOCK,
                                                        INTERPRETED=INTERPRETED, num_warps=4)
    return out
