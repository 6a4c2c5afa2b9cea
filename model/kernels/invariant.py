"""Batch-invariant kernels in triton: a row's result is the same bits whatever else is in the batch.

  matmul          y = x W^T in fixed tiles, K walked in order; the K-splits depend on W's shape (and the
                  SM count) alone and are summed in split order
  grouped_matmul  the experts' y_i = x_i W_{e(i)}^T over rows sorted by expert, the same tiles within
                  each expert's rows, no split-K; the weight dense or chunked for the tiles (ChunkedWeight)
  row_sum         a sum (or sum of squares) over the last dim, one program per row in fixed-width chunks

Both matmuls also take FP8-dynamic operands, the scales applied to each tile before it is stored.
model.batch_invariant decides when they run; why the order is fixed this way: docs/kernels.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from model.kernels.launch import INTERPRETED, sm_count


class Tiles(NamedTuple):
    """A kernel's tile shape and launch. Fixed per kernel in the mode: a row's sums depend on BK only,
    but which MMA instructions a tile compiles to depends on all of it."""
    m: int
    n: int
    k: int
    warps: int
    stages: int
    # grouped kernel: the weight's columns as the MMA's rows (y^T = W x^T), so a few rows an expert fill
    # the MMA's narrow side (Hopper's is 8-256 wide) instead of wasting most of its 64 tall side
    swap: bool = False


# as near to cuBLAS's shape-tuned tiles as one fixed tile gets across batch sizes (128-row tiles lose less
# than 64-row ones at hundreds of rows)
MATMUL_TILES = Tiles(128, 128, 64, 8, 3)
# tuned for the experts at DiffusionGemma's batch 1-2 (16-32 rows per expert), where it beats grouped_mm
GROUPED_TILES = Tiles(64, 128, 64, 8, 3)
# FP8 operands: 128 K a step (FP8 MMAs are 32 deep); the dense ones not tuned. The grouped tiles (the FP8
# experts, which read their weights chunked for them: ChunkedWeight) are 64 K a step, one warpgroup, 6
# stages: the best of benchmarks/fp8_experts_bench.py's sweep for both projections at DiffusionGemma's
# shapes, from one canvas to many
FP8_MATMUL_TILES = Tiles(128, 128, 128, 8, 3)
FP8_GROUPED_TILES = Tiles(64, 128, 64, 4, 6)
MAX_SPLITS = 8
ROWS_PER_LAUNCH = 512    # bounds the split-K workspace (splits x 512 x N fp32)
ROW_BLOCK = 1024


def k_splits(n: int, k: int, device: torch.device, tiles: Tiles = MATMUL_TILES) -> int:
    """Splits of K for a weight [n, k]: enough programs to fill the GPU at a single row tile (two per
    SM), a power of two, each split at least 4 chunks deep. A function of the weight alone."""
    tiles_n = triton.cdiv(n, tiles.n)
    want = max(1, min(MAX_SPLITS, 2 * sm_count(device) // tiles_n, k // (4 * tiles.k)))
    return 1 << (want.bit_length() - 1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" only names the default for 16-bit inputs


def _imprecise_acc(scaled: bool, tiles: Tiles) -> int | None:
    """FP8 dots: Hopper's FP8 MMAs add into a narrower accumulator than fp32, and triton lets one run over
    the whole K loop; promoted to fp32 after every chunk instead (as cuBLAS's default, not fast
    accumulation, does), a long K stays within fp32 summation of the reference. None: the default (16-bit)."""
    return tiles.k if scaled else None


def _scales(x_scale: torch.Tensor, w_scale: torch.Tensor, rows: int,
            channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 scales as the kernels index them: contiguous fp32, one a row and one an output channel."""
    x_scale, w_scale = x_scale.reshape(-1).float().contiguous(), w_scale.reshape(-1).float().contiguous()
    assert x_scale.numel() == rows and w_scale.numel() == channels, (x_scale.shape, w_scale.shape, rows, channels)
    return x_scale, w_scale


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, sos, som, son,
                   K_PER_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SCALED: tl.constexpr, IMPRECISE_ACC: tl.constexpr, PRECISION: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)   # int64: a 262144 x 8192 table passes 2^31 elements
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BK):  # a multiple of BK: chunks never straddle splits
        kk = pid_s * K_PER_SPLIT + k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)
        if INTERPRETED:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, max_num_imprecise_acc=IMPRECISE_ACC)
    if SCALED:   # this split's partial, scaled: the splits then add scaled partials in order
        acc = (acc * tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[:, None]
               * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[None, :])
    out = out_ptr + pid_s * sos + rm[:, None] * som + rn[None, :] * son
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, S):  # split order, whatever the number of rows
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def matmul(x: torch.Tensor, w: torch.Tensor, tiles: Tiles | None = None, x_scale: torch.Tensor | None = None,
           w_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in x's dtype (w any strides: w may be a transposed view).
    FP8 (module docstring): x and w float8_e4m3fn with x_scale [rows] and w_scale [N] (fp32), -> out_dtype.
    `splits`: K-splits instead of k_splits' (benchmarks/fp8_gemm_bench.py's sweep; still a function of
    the call, not of the rows, so a fixed value keeps the kernel batch-invariant)."""
    scaled = x_scale is not None
    assert not scaled or out_dtype is not None, "FP8 operands: say the output's dtype"
    tiles = tiles or (FP8_MATMUL_TILES if scaled else MATMUL_TILES)
    n, k = w.shape
    rows = x.reshape(-1, k)
    if scaled:
        x_scale, w_scale = _scales(x_scale, w_scale, rows.shape[0], n)
    out = torch.empty(rows.shape[0], n, dtype=out_dtype if scaled else x.dtype, device=x.device)
    splits = splits or k_splits(n, k, x.device, tiles)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tiles.k) * tiles.k
    for lo in range(0, rows.shape[0], ROWS_PER_LAUNCH):   # host-side shapes only: no sync
        a, y = rows[lo: lo + ROWS_PER_LAUNCH], out[lo: lo + ROWS_PER_LAUNCH]
        a_scale = x_scale[lo: lo + ROWS_PER_LAUNCH] if scaled else a
        m = a.shape[0]
        target = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, tiles.m), triton.cdiv(n, tiles.n), splits)
        _matmul_kernel[grid](a, a_scale, w, w_scale if scaled else w, target, m, n, k, a.stride(0), a.stride(1),
                             w.stride(0), w.stride(1), target.stride(0) if splits > 1 else 0, n, 1,
                             K_PER_SPLIT=k_per_split, BM=tiles.m, BN=tiles.n, BK=tiles.k, SCALED=scaled,
                             IMPRECISE_ACC=_imprecise_acc(scaled, tiles), PRECISION=_precision(x.dtype),
                             INTERPRETED=INTERPRETED, num_warps=tiles.warps, num_stages=tiles.stages)
        if splits > 1:
            _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](target, y, m * n, S=splits, BLOCK=1024)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _grouped_kernel(x_ptr, xs_ptr, rows_ptr, w_ptr, ws_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr, N, E,
                    sxm, swe, swn, swk, som, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GATHER: tl.constexpr, SCALED: tl.constexpr, SWAP: tl.constexpr, CHUNKED: tl.constexpr,
                    IMPRECISE_ACC: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
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
        # CHUNKED (ChunkedWeight): this tile's K-chunk is [BN, width] row-major, one contiguous read
        block = w_ptr + e.to(tl.int64) * swe + pid_n.to(tl.int64) * (BN * K)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + src[:, None] * sxm + kk[None, :], mask=(rm[:, None] < row_end) & (kk[None, :] < K),
                        other=0.0)
            width = tl.minimum(K - k0, BK)
            if SWAP:
                if CHUNKED:
                    b = tl.load(block + k0 * BN + tl.arange(0, BN)[:, None] * width + rk[None, :],
                                mask=rk[None, :] < width, other=0.0)
                else:
                    b = tl.load(w_ptr + e * swe + rn[:, None] * swn + kk[None, :] * swk,
                                mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
                if INTERPRETED:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(b, tl.trans(a), acc, input_precision=PRECISION, max_num_imprecise_acc=IMPRECISE_ACC)
            else:
                if CHUNKED:
                    b = tl.load(block + k0 * BN + tl.arange(0, BN)[None, :] * width + rk[:, None],
                                mask=rk[:, None] < width, other=0.0)
                else:
                    b = tl.load(w_ptr + e * swe + rn[None, :] * swn + kk[:, None] * swk,
                                mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
                if INTERPRETED:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION, max_num_imprecise_acc=IMPRECISE_ACC)
        if SWAP:
            acc = tl.trans(acc)
        if SCALED:   # a gathered row's scale is its token's
            acc = (acc * tl.load(xs_ptr + src, mask=rm < row_end, other=0.0)[:, None]
                   * tl.load(ws_ptr + e * N + rn, mask=rn < N, other=0.0)[None, :])
        tl.store(out_ptr + rm[:, None] * som + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < row_end) & (rn[None, :] < N))


class ChunkedWeight(NamedTuple):
    """The experts' weight [E, N, K] as the grouped kernel reads it fastest: each expert's rows in blocks of
    `block_n` (the last padded with zero rows), each block's K cut into `block_k`-wide chunks stored one
    after another, a chunk [block_n, width] row-major (width block_k; the last chunk, what is left of K).
    A tile's weight for one step of K is then one contiguous read (8 KB for FP8 128 x 64) instead of
    block_n pieces of block_k bytes a row apart. The same values, so the same products and bits."""
    data: torch.Tensor   # [E, ceil(N / block_n), block_n * K]
    n: int
    k: int
    block_n: int
    block_k: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense weight's [E, N, K]."""
        return self.data.shape[0], self.n, self.k

    def dense(self) -> torch.Tensor:
        """Back to [E, N, K] (tests; a reference that reads the weight)."""
        e, blocks, (bn, bk, k) = self.data.shape[0], self.data.shape[1], (self.block_n, self.block_k, self.k)
        full = k // bk * bk
        head = self.data[..., :bn * full].reshape(e, blocks, full // bk, bn, bk).permute(0, 1, 3, 2, 4)
        tail = self.data[..., bn * full:].reshape(e, blocks, bn, k - full)
        return torch.cat([head.reshape(e, blocks, bn, full), tail], -1).reshape(e, blocks * bn, k)[:, :self.n]


def chunk_weight(w: torch.Tensor, block_n: int, block_k: int) -> ChunkedWeight:
    """w [E, N, K] -> ChunkedWeight (a new tensor; w is left as it was)."""
    e, n, k = w.shape
    blocks, full = triton.cdiv(n, block_n), k // block_k * block_k
    padded = torch.zeros(e, blocks * block_n, k, dtype=w.dtype, device=w.device)
    padded[:, :n] = w
    padded = padded.view(e, blocks, block_n, k)
    head = padded[..., :full].reshape(e, blocks, block_n, full // block_k, block_k).permute(0, 1, 3, 2, 4)
    tail = padded[..., full:]
    data = torch.cat([head.reshape(e, blocks, block_n * full), tail.reshape(e, blocks, -1)], -1)
    return ChunkedWeight(data.contiguous(), n, k, block_n, block_k)


def make_tile_map(ends: torch.Tensor, num_tiles: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For groups ending at `ends` [E], the expert (E for a spare tile) and first row of each of
    `num_tiles` block_m-row tiles, each group's rows in ceil(count / block_m) tiles, in group order."""
    ends = ends.to(torch.int64)
    e = ends.shape[0]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(per_expert, 0)
    t = torch.arange(num_tiles, device=ends.device)
    expert = torch.searchsorted(tile_end, t, right=True)
    owner = expert.clamp(max=e - 1)
    return expert, (ends - counts)[owner] + (t - (tile_end - per_expert)[owner]) * block_m


def grouped_matmul(x: torch.Tensor, w: torch.Tensor | ChunkedWeight, ends: torch.Tensor,
                   rows: torch.Tensor | None = None, tile_map: tuple[torch.Tensor, torch.Tensor] | None = None,
                   tiles: Tiles | None = None,
                   x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows of x [P, K] sorted by group, group g = rows [ends[g-1], ends[g]) -> x_g @ w[g]^T ([E, N, K]).
    With `rows` [P], the sorted problem's row i is x[rows[i]] (read in place: no gathered copy of x).
    The tile map (which expert, which first row of each tiles.m-row tile; model.kernels.routing makes it
    with the sort) is made here on the device when not given: no sync, a grid of fixed size. FP8 (module
    docstring): x and w float8_e4m3fn with x_scale [T or P] (gathered with x's rows) and w_scale [E, N]
    (fp32), -> out_dtype. `w` may be a ChunkedWeight chunked for `tiles`' columns and K step."""
    scaled = x_scale is not None
    assert not scaled or out_dtype is not None, "FP8 operands: say the output's dtype"
    tiles = tiles or (FP8_GROUPED_TILES if scaled else GROUPED_TILES)
    chunked = isinstance(w, ChunkedWeight)
    assert not chunked or (w.block_n, w.block_k) == (tiles.n, tiles.k), "a weight chunked for other tiles"
    assert x.shape[-1] == w.shape[2], ("rows and weight of different K", x.shape, w.shape)
    x = x.contiguous()
    p, k = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    e, n, _ = w.shape
    if scaled:
        x_scale, w_scale = _scales(x_scale, w_scale, x.shape[0], e * n)
    max_tiles = triton.cdiv(p, tiles.m) + e   # sum ceil(c / BM) <= P / BM + E
    expert, row = tile_map if tile_map is not None else make_tile_map(ends, max_tiles, tiles.m)
    assert expert.shape[0] == max_tiles, "a tile map for another problem or tile height"
    out = torch.empty(p, n, dtype=out_dtype if scaled else x.dtype, device=x.device)
    weight, strides = (w.data, (w.data.stride(0), 0, 0)) if chunked else (w, w.stride())
    _grouped_kernel[(max_tiles, triton.cdiv(n, tiles.n))](
        x, x_scale if scaled else x, x if rows is None else rows, weight, w_scale if scaled else weight, out,
        expert, row, ends, n, e, x.stride(0), *strides, out.stride(0), K=k, BM=tiles.m, BN=tiles.n, BK=tiles.k,
        GATHER=rows is not None, SCALED=scaled, SWAP=tiles.swap, CHUNKED=chunked,
        IMPRECISE_ACC=_imprecise_acc(scaled, tiles), PRECISION=_precision(x.dtype), INTERPRETED=INTERPRETED,
        num_warps=tiles.warps, num_stages=tiles.stages)
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as [rows, d] with unit stride along d (what the row kernels index), and d."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    return (rows if rows.stride(-1) == 1 else rows.contiguous()), d


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, sx, D: tl.constexpr, SQUARE: tl.constexpr, FP64: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float64 if FP64 else tl.float32)
    for off in range(0, D, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * sx + cols, mask=cols < D, other=0.0).to(acc.dtype)
        acc += v * v if SQUARE else v
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def row_sum(x: torch.Tensor, square: bool = False, fp64: bool = False) -> torch.Tensor:
    """sum over the last dim (of squares with `square`) -> x.shape[:-1], accumulated and returned in fp32
    (fp64 with `fp64` or for an fp64 x)."""
    rows, d = _rows(x)
    fp64 = fp64 or x.dtype == torch.float64
    out = torch.empty(rows.shape[0], dtype=torch.float64 if fp64 else torch.float32, device=x.device)
    if rows.shape[0]:
        _row_sum_kernel[(rows.shape[0],)](rows, out, rows.stride(0), D=d, SQUARE=square, FP64=fp64,
                                          BLOCK=max(16, min(ROW_BLOCK, triton.next_power_of_2(d))))
    return out.view(x.shape[:-1])


@triton.jit
def _row_cumsum_kernel(x_ptr, out_ptr, sx, so, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    carry = tl.zeros((1,), dtype=tl.float32)
    for off in range(0, D, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * sx + cols, mask=cols < D, other=0.0).to(tl.float32)
        c = tl.cumsum(v, axis=0) + carry
        tl.store(out_ptr + row * so + cols, c, mask=cols < D)
        carry = tl.sum(tl.where(tl.arange(0, BLOCK) == BLOCK - 1, c, 0.0), axis=0, keep_dims=True)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum over the last dim in fp32, one program per row (torch's scan picks its
    chunking by the number of rows)."""
    rows, d = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _row_cumsum_kernel[(rows.shape[0],)](rows, out, rows.stride(0), out.stride(0), D=d,
                                             BLOCK=max(16, min(ROW_BLOCK, triton.next_power_of_2(d))))
    return out.view(x.shape)
