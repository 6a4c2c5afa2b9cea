"""FP8-dynamic matmuls on Hopper (model/fp8.py's arithmetic): activations arrive already quantized per
row (xq float8_e4m3fn, sx [rows] fp32; model.fused quantizes them in their producer's kernel), weights
are float8_e4m3fn with one fp32 scale per output channel, and the scales meet in the fp32 epilogue:

    y[m, n] = (sum_k xq[m, k] Wq[n, k]) * sx[m] * sw[n],   rounded once to the output dtype

  scaled_linear   a dense layer: cuBLAS's FP8 GEMM with row-wise scales (torch._scaled_mm)
  scaled_grouped  the experts over rows sorted by expert: few rows per expert, our triton kernel (it reads
                  each pair's token row in place and streams the weights, where the batch is small and the
                  step is a weight read); many, CUTLASS's grouped FP8 GEMM (torch._scaled_grouped_mm)

Both are CUDA-graph capturable (no host sync, fixed grids) and not batch-invariant: the batch-invariant
mode runs model/fp8.py's reference instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.invariant import Tiles, make_tile_map

# FP8 tiles for the grouped kernel: 64 rows (DiffusionGemma's batch 1-2 has 16-32 rows per expert),
# 128 K a step (FP8 MMAs are 32 deep)
FP8_GROUPED_TILES = Tiles(64, 128, 128, 8, 3)


def scaled_linear(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] FP8, sx [M] fp32, weight [N, K] FP8, weight_scale [N, 1] fp32 -> [M, N] out_dtype."""
    return torch._scaled_mm(xq, weight.t(), scale_a=sx.view(-1, 1), scale_b=weight_scale.view(1, -1),
                            out_dtype=out_dtype)


@triton.jit
def _fp8_grouped_kernel(x_ptr, sx_ptr, rows_ptr, w_ptr, sw_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
                        N, E, sxm, swe, swn, som, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GATHER: tl.constexpr):
    """One BM x BN tile of one expert's rows: FP8 x FP8 into fp32, the row and channel scales at the end."""
    t, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + t)
    if e < E:  # tiles past the last expert's are spare (the grid is sized for the worst case)
        row_end = tl.load(ends_ptr + e)
        rm = tl.load(tile_row_ptr + t).to(tl.int64) + tl.arange(0, BM)
        src = rm
        if GATHER:   # row i of the sorted problem is row rows[i] of x
            src = tl.load(rows_ptr + rm, mask=rm < row_end, other=0)
        rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + src[:, None] * sxm + kk[None, :], mask=(rm[:, None] < row_end) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(w_ptr + e * swe + rn[None, :] * swn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        sx = tl.load(sx_ptr + src, mask=rm < row_end, other=0.0)
        sw = tl.load(sw_ptr + e * N + rn, mask=rn < N, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
        tl.store(out_ptr + rm[:, None] * som + rn[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < row_end) & (rn[None, :] < N))


def grouped_in_triton(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      ends: torch.Tensor, rows: torch.Tensor | None, out_dtype: torch.dtype,
                      tile_map: tuple[torch.Tensor, torch.Tensor] | None = None,
                      tiles: Tiles = FP8_GROUPED_TILES) -> torch.Tensor:
    """model.kernels.invariant.grouped_matmul's problem in FP8: xq [T or P, K] with sx [T or P], w [E, N, K]
    with w_scale [E, N]; `rows` [P] gathers xq's (and sx's) rows in the kernel."""
    p, k = (xq.shape[0] if rows is None else rows.shape[0]), xq.shape[1]
    e, n, _ = w.shape
    max_tiles = triton.cdiv(p, tiles.m) + e
    if tile_map is None or tile_map[0].shape[0] != max_tiles:   # the routing's map is for its own tile height
        tile_map = make_tile_map(ends, max_tiles, tiles.m)
    expert, row = tile_map
    out = torch.empty(p, n, dtype=out_dtype, device=xq.device)
    _fp8_grouped_kernel[(max_tiles, triton.cdiv(n, tiles.n))](
        xq, sx, xq if rows is None else rows, w, w_scale, out, expert, row, ends, n, e, xq.stride(0), w.stride(0),
        w.stride(1), out.stride(0), K=k, BM=tiles.m, BN=tiles.n, BK=tiles.k, GATHER=rows is not None,
        num_warps=tiles.warps, num_stages=tiles.stages)
    return out


def grouped_in_cutlass(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       ends: torch.Tensor, rows: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The same problem through torch._scaled_grouped_mm (rows gathered first: it reads them in order)."""
    if rows is not None:
        xq, sx = xq[rows], sx[rows]
    return torch._scaled_grouped_mm(xq, w.transpose(1, 2), sx.contiguous(), w_scale, offs=ends, out_dtype=out_dtype)


# rows per expert (on average) up to which the triton kernel is used; above, CUTLASS's
FEW_ROWS_PER_EXPERT = 32


def scaled_grouped(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   ends: torch.Tensor, rows: torch.Tensor | None, out_dtype: torch.dtype,
                   tile_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The experts' FP8 grouped matmul -> [P, N] out_dtype (module docstring)."""
    p = xq.shape[0] if rows is None else rows.shape[0]
    if p <= FEW_ROWS_PER_EXPERT * w.shape[0]:
        return grouped_in_triton(xq, sx, w, w_scale, ends, rows, out_dtype, tile_map)
    return grouped_in_cutlass(xq, sx, w, w_scale, ends, rows, out_dtype)
