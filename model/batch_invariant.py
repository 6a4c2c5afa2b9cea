"""Batch-invariant mode: a request's tokens and scores are the same bits alone or in any batch (CUDA).

A runner made with `batch_invariant=True` enters the mode around each command, graph captures included.
Inside it the ops below (linear and grouped matmuls, row sums, norms' mean squares, scans, softmax,
attention, tensor-parallel sums, the experts' combine) run model.kernels.invariant's fixed-order kernels
or add their parts in order, so no reduction's order depends on the batch's shape; with the mode off
they are the plain torch ops. It costs speed, so it is opt-in, for bf16/fp16/fp32 models. Which
reductions depend on the batch, and how these fix them: docs/kernels.md.
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
    refuses the mode); the ordered TP sum runs on any. Process-wide: one Runner per process uses it."""
    global _enabled
    previous, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = previous


def _kernels():
    from model.kernels import invariant

    return invariant


# an opaque op to torch.compile: a fused chain keeps its elementwise kernels and calls this for its sums
@torch.library.custom_op("dllm::row_sum", mutates_args=())
def _row_sum_op(x: torch.Tensor, square: bool, fp64: bool) -> torch.Tensor:
    return _kernels().row_sum(x, square=square, fp64=fp64)


@_row_sum_op.register_fake
def _(x: torch.Tensor, square: bool, fp64: bool) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float64 if fp64 or x.dtype == torch.float64 else torch.float32)


def sum_in_order(parts: torch.Tensor) -> torch.Tensor:
    """((parts[0] + parts[1]) + parts[2]) + ... over the leading dim: elementwise adds, so the order is
    the same for every element whatever the shape (a reduction kernel would pick its own)."""
    return sum(parts[1:].unbind(0), parts[0])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (weight [out, in])."""
    if _enabled and x.is_cuda:
        return _kernels().matmul(x, weight)
    return F.linear(x, weight)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, rows: torch.Tensor | None = None,
                   tile_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The fixed-order grouped matmul: model.moe's experts in the mode, and outside it where
    each expert has few rows (there it reads the weights faster than grouped_mm); `rows` gathers x's rows
    in the kernel, `tile_map` is the routing's (else made here)."""
    return _kernels().grouped_matmul(x, w, ends, rows, tile_map)


def row_sum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the last dim, returned in `dtype` (default x's; in the mode accumulated in fp32, or fp64
    when dtype is)."""
    if _enabled and x.is_cuda:
        return _row_sum_op(x, False, dtype == torch.float64).to(dtype or x.dtype)
    return x.sum(-1, dtype=dtype)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    if _enabled and x.is_cuda:
        return (_row_sum_op(x, False, False) / x.shape[-1]).to(x.dtype)
    return x.mean(-1)


def mean_square(h: torch.Tensor) -> torch.Tensor:
    """mean(h^2) over the last dim, keepdim (an RMS norm's), in h's dtype."""
    if _enabled and h.is_cuda:
        return (_row_sum_op(h, True, False) / h.shape[-1]).to(h.dtype).unsqueeze(-1)
    return h.pow(2).mean(-1, keepdim=True)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum over the last dim, in x's dtype."""
    if _enabled and x.is_cuda:
        return _kernels().row_cumsum(x).to(x.dtype)
    return torch.cumsum(x, dim=-1)


def softmax(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax over the last dim in `dtype`."""
    if _enabled and x.is_cuda:
        e = torch.exp(x.to(dtype) - x.amax(-1, keepdim=True).to(dtype))
        return e / row_sum(e).unsqueeze(-1)
    return torch.softmax(x, dim=-1, dtype=dtype)
