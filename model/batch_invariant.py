"""Batch-invariant mode: a request's tokens and scores are the same bits alone or in any batch (CUDA).

In bf16 a row's logits depend on its neighbours unless every reduction a forward and its sampler
make runs in an order fixed by the row alone: cuBLAS and grouped_mm choose split-K and tiles by the
whole batch's shape, torch's reductions choose their trees by the number of rows, and NCCL chunks an
all-reduce by message size. With the mode on (a Runner made with `batch_invariant=True` enters it
around each command, graph captures included) the ops below route every such reduction to
model.kernels.invariant's fixed-order kernels:

    linear, grouped_linear    fixed tiles and K-splits chosen by the weight's shape
    row_sum, mean_square      one program per row (norms, the router's weights, the sampler's sums)
    attention                 the memory-efficient SDPA kernel (per query block, keys in order; a
                              longer padded key range adds exact zeros)
    all_reduce (TP > 1)       every rank's part gathered and summed in rank order

Everything else in a forward is elementwise or exact (gathers, maxima, integer counts). The mode off,
these are the plain torch ops. It costs speed (report: the README's speed table), so it is opt-in.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_enabled = False   # a module global: torch.compile guards on it, so fused chains compile once per mode


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """The mode on (or off) inside the block. Its kernels run on CUDA tensors (a Runner on another device
    refuses the mode); the ordered TP sum runs on any."""
    global _enabled
    previous, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = previous


def _kernels():
    from model.kernels import invariant

    return invariant


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (weight [out, in])."""
    if _enabled and x.is_cuda:
        return _kernels().matmul(x, weight)
    return F.linear(x, weight)


def row_sum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the last dim, in `dtype` (default: x's, at least fp32 in the mode)."""
    if _enabled and x.is_cuda:
        return _kernels().row_sum(x, fp64=dtype == torch.float64).to(dtype or x.dtype)
    return x.sum(-1, dtype=dtype)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    if _enabled and x.is_cuda:
        return (_kernels().row_sum(x) / x.shape[-1]).to(x.dtype)
    return x.mean(-1)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The mode's grouped matmul (model.diffusion_gemma picks it while the mode is on)."""
    return _kernels().grouped_matmul(x, w, ends)


def mean_square(h: torch.Tensor) -> torch.Tensor:
    """mean(h^2) over the last dim, keepdim (an RMS norm's), in h's dtype."""
    if _enabled and h.is_cuda:
        return (_kernels().row_sum(h, square=True) / h.shape[-1]).to(h.dtype).unsqueeze(-1)
    return h.pow(2).mean(-1, keepdim=True)
