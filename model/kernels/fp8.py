"""FP8-dynamic matmuls on Hopper (model/fp8.py's arithmetic), the scales applied in the fp32 epilogue:

    y[m, n] = (sum_k xq[m, k] Wq[n, k]) * sx[m] * sw[n],   rounded once to the output dtype

scaled_linear: cuBLAS's FP8 GEMM, or our split-K kernel for a few rows through a deep weight (the down
projections). scaled_grouped: the experts through our triton grouped kernel, which reads each pair's
token row in place and, once the weights are chunked for its tiles at load, runs at every batch; a dense
weight with many rows an expert goes to CUTLASS. All capturable in CUDA graphs; with `invariant` the
fixed-order kernels of model.kernels.invariant run instead. Why: docs/kernels.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from model.kernels.invariant import FP8_GROUPED_TILES, ChunkedWeight, Tiles, grouped_matmul, matmul


# rows up to which a weight with K >= 2 N goes to the split-K kernel: there it beat cuBLAS on the 8B's
# down projection (4096 x 14336), at 128 rows the two were even, and on the other projections cuBLAS was
# as fast or faster (benchmarks/fp8_gemm_bench.py)
SPLIT_K_ROWS = 32


def split_k_wins(rows: int, n: int, k: int) -> bool:
    """Whether scaled_linear takes the split-K kernel for `rows` rows through an [n, k] weight."""
    return rows <= SPLIT_K_ROWS and k >= 2 * n


def scaled_linear(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  out_dtype: torch.dtype, invariant: bool = False) -> torch.Tensor:
    """xq [M, K] FP8, sx [M] fp32, weight [N, K] FP8, weight_scale [N, 1] fp32 -> [M, N] out_dtype."""
    if invariant or (xq.is_cuda and split_k_wins(xq.shape[0], *weight.shape)):
        return matmul(xq, weight, x_scale=sx, w_scale=weight_scale.view(-1), out_dtype=out_dtype)
    return torch._scaled_mm(xq, weight.t(), scale_a=sx.view(-1, 1), scale_b=weight_scale.view(1, -1),
                            out_dtype=out_dtype)


class ExpertTiles(NamedTuple):
    """The triton grouped kernel's tiles for each of the experts' two projections: one height, so the
    routing's one tile map serves both (model.moe.sort_pairs makes it for `m`)."""
    gate_up: Tiles
    down: Tiles

    @property
    def m(self) -> int:
        return self.gate_up.m


# benchmarks/fp8_experts_bench.py times the candidates at DiffusionGemma's shapes
EXPERT_TILES = ExpertTiles(gate_up=FP8_GROUPED_TILES, down=FP8_GROUPED_TILES)
assert EXPERT_TILES.gate_up.m == EXPERT_TILES.down.m


def grouped_in_triton(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor | ChunkedWeight, w_scale: torch.Tensor,
                      ends: torch.Tensor, rows: torch.Tensor | None, out_dtype: torch.dtype,
                      tile_map: tuple[torch.Tensor, torch.Tensor] | None = None,
                      tiles: Tiles | None = None) -> torch.Tensor:
    """model.kernels.invariant.grouped_matmul's problem in FP8: xq [T or P, K] with sx [T or P], w [E, N, K]
    with w_scale [E, N] (or w chunked for the tiles: ChunkedWeight); `rows` [P] gathers xq's (and sx's) rows
    in the kernel. `tiles`: FP8_GROUPED_TILES unless given (a given tile map must be for its height)."""
    return grouped_matmul(xq, w, ends, rows, tile_map, tiles, x_scale=sx, w_scale=w_scale, out_dtype=out_dtype)


def grouped_in_cutlass(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       ends: torch.Tensor, rows: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The same problem through torch._scaled_grouped_mm (rows gathered first: it reads them in order)."""
    if rows is not None:
        xq, sx = xq[rows], sx[rows]
    return torch._scaled_grouped_mm(xq, w.transpose(1, 2), sx.contiguous(), w_scale, offs=ends, out_dtype=out_dtype)


# rows per expert (on average) up to which the triton kernel takes a dense weight; above, CUTLASS's (a chunked
# weight, as the served experts' are, always goes to the triton kernel)
FEW_ROWS_PER_EXPERT = 32


def scaled_grouped(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor | ChunkedWeight, w_scale: torch.Tensor,
                   ends: torch.Tensor, rows: torch.Tensor | None, out_dtype: torch.dtype,
                   tile_map: tuple[torch.Tensor, torch.Tensor] | None = None, invariant: bool = False,
                   tiles: Tiles | None = None) -> torch.Tensor:
    """The experts' FP8 grouped matmul -> [P, N] out_dtype (module docstring); `tiles` the triton kernel's
    (one of EXPERT_TILES, with the tile map made for its height). A chunked weight goes to the triton kernel
    whatever the rows: CUTLASS reads only the dense layout."""
    p = xq.shape[0] if rows is None else rows.shape[0]
    if invariant or isinstance(w, ChunkedWeight) or p <= FEW_ROWS_PER_EXPERT * w.shape[0]:
        return grouped_in_triton(xq, sx, w, w_scale, ends, rows, out_dtype, tile_map, tiles)
    return grouped_in_cutlass(xq, sx, w, w_scale, ends, rows, out_dtype)
