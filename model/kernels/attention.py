"""Attention over a paged KV cache read in place (CUDA): model.attention.cached_attention's gather and
masked SDPA without the gather or a mask tensor, each query's keys decided from its row's (slot, start,
length, causal) and the sliding window, each key found through the slot's page table.

One program per (block of (query, head-of-group) pairs, KV head, key split) walks only the key blocks its
queries can see; splits (flash-decoding) fill idle SMs and are combined in split order. With `invariant`
the tiles come from the head dim alone and there is one split, so a row's output does not depend on its
neighbours. The mask rule, the pipelined key loop and the tiles: docs/kernels.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.launch import INTERPRETED, sm_count

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 256
# fp32 values of the split combine's accumulator per program (its rows x the head dim, over 4 warps):
# the combine streams the partials once, so it takes small tiles and many programs; the attention
# program's rows (64-128 at head dim 512) held 255 registers a thread there and left most SMs idle
COMBINE_VALUES = 4096


# (query rows, keys, warps, pipeline stages) per program by head dim, for one row / for several (or
# batch-invariant mode), timed at the served shapes: the 8B's 32-position canvases at head dim 128,
# DiffusionGemma's 256-token canvas over its sliding window at 256 and its full layers' keys at 512 (where
# the fp32 accumulator [rows, 512] bounds the rows); the lone-canvas tiles at 256 and 512 in one CUDA
# graph of a 26B-A4B step's 30 attention calls (benchmarks/attention_bench.py times them)
TILES = {128: ((32, 64, 4, 2), (64, 64, 4, 2)), 256: ((128, 64, 8, 2), (128, 32, 8, 2)),
         512: ((64, 64, 8, 1), (64, 32, 8, 2))}


def _config(d: int, rows: int, batch: int, hkv: int, keys: int, device: torch.device,
            invariant: bool, itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """(query rows, keys, warps, stages, splits) per program for `batch` x `hkv` kv heads of `rows`
    (query, head) pairs each over up to `keys` keys: TILES' first for a lone row, the second otherwise;
    keys split only while the programs are at most half the SMs, into as many splits as fit the SMs
    once (more make a second wave, which costs more than the splits save) and >= MIN_SPLIT_KEYS keys each. Invariant: the second tiles whatever the batch, and one split.
    fp32 operands (`itemsize` 4) take twice a tile's shared memory: half the rows and keys, one stage
    (at head dim 512 the bf16 tiles would ask 256-384 KiB of the H200's 227; tests/hopper_kernels.py)."""
    bm, bn, warps, stages = TILES[next(t for t in TILES if d <= t)][1 if invariant or batch > 1 else 0]
    if itemsize > 2:
        bm, bn, stages = max(16, bm // 2), max(16, bn // 2), 1
    programs = batch * hkv * triton.cdiv(rows, bm)
    sms = sm_count(device)
    if invariant or 2 * programs > sms:
        return bm, bn, warps, stages, 1
    return bm, bn, warps, stages, max(1, min(MAX_SPLITS, sms // programs, triton.cdiv(keys, MIN_SPLIT_KEYS)))


@triton.jit
def _key_block(n0, s_hi, q, k_ptr, v_ptr, pt_ptr, slot, spt, skp, skh, svp, svh, h, d, d_ok, start,
               bidirectional, qpos, anchor, W, i, length, qk_scale, m_i, l_i, acc, BN: tl.constexpr,
               PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Keys n0 .. n0 + BN - 1 (those below s_hi) into the block's online-softmax state (m_i, l_i, acc);
    position p is row page * PAGE + p % PAGE of the cache, page the slot's page table entry p // PAGE."""
    p = n0 + tl.arange(0, BN)
    p_ok = p < s_hi
    page = tl.load(pt_ptr + slot * spt + p // PAGE, mask=p_ok, other=0)
    row = page * PAGE + p % PAGE
    kt = tl.load(k_ptr + row[None, :] * skp + h * skh + d[:, None], mask=p_ok[None, :] & d_ok[:, None], other=0.0)
    vt = tl.load(v_ptr + row[:, None] * svp + h * svh + d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    if INTERPRETED:
        kt, vt = kt.to(tl.float32), vt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    see = p_ok[None, :] & ((p[None, :] < start) | bidirectional | (p[None, :] <= qpos[:, None]))
    if HAS_WINDOW:
        see = see & ((p[None, :] > anchor[:, None] - W) | (i[:, None] >= length))
    s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    e = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(e, 1)
    acc = acc * alpha[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, l_i, acc


# L (the query width) is not specialized on (1, multiples of 16): a prefill of any width runs the variants
# the graph set compiled
@triton.jit(do_not_specialize=["L"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, out_ptr, part_ptr, ml_ptr, slot_ptr, start_ptr, length_ptr, causal_ptr,
                 sqb, sql, sqh, spt, skp, skh, svp, svh, sob, sol, soh,
                 L, W, qk_scale, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, ITERS: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_m, pid_bh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)   # a value, not a constexpr: every split count runs one compiled variant
    b, h = (pid_bh // HKV).to(tl.int64), (pid_bh % HKV).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)
    length = tl.load(length_ptr + b).to(tl.int64)
    causal = tl.load(causal_ptr + b) != 0
    bidirectional = tl.load(causal_ptr + b) == 0
    end = start + length

    LG = L * G
    r = pid_m * BM + tl.arange(0, BM)          # (query, head of the group) pairs
    row_ok = r < LG
    i = (r // G).to(tl.int64)
    head = h * G + (r % G)
    qpos = start + i
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sqb + i[:, None] * sql + head[:, None] * sqh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if INTERPRETED:
        q = q.to(tl.float32)

    # the block's key range: every key outside it is masked for all of its queries
    i_min = (pid_m * BM) // G
    i_max = tl.minimum(pid_m * BM + BM - 1, LG - 1) // G
    hi = tl.where(causal, tl.minimum(end, start + i_max + 1), end)
    # a block of padding queries alone (a row padded to a graph's width) reads no key: its outputs, never
    # read, are 0 (l = 0), finite for the layers after it
    hi = tl.where(i_min < length, hi, 0)
    lo = start * 0
    if HAS_WINDOW:
        anchor_min = tl.where(causal, start + i_min, start)
        # from the block's first query's window on, if the block has a real query: its padding queries
        # (past the row's length, never read) then see the block's keys, never none
        lo = tl.where(i_min < length, tl.maximum(lo, anchor_min - W + 1), lo)
    lo = lo // BN * BN   # key blocks at multiples of BN: the same blocks whatever the neighbours
    span = tl.maximum(hi - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, splits), BN) * BN
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)

    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BLOCK_D), dtype=tl.float32)
    anchor = qpos   # read only under a window
    if HAS_WINDOW:
        anchor = tl.where(causal, qpos, start)
    if INTERPRETED:
        # a constexpr trip count (the interpreter takes no loaded bound); the blocks past s_hi skip
        for it in range(ITERS):
            n0 = s_lo + it * BN
            if n0 < s_hi:
                m_i, l_i, acc = _key_block(n0, s_hi, q, k_ptr, v_ptr, pt_ptr, slot, spt, skp, skh, svp, svh, h, d,
                                           d_ok, start, bidirectional, qpos, anchor, W, i, length, qk_scale,
                                           m_i, l_i, acc, BN, PAGE, HAS_WINDOW, PRECISION, INTERPRETED)
    else:   # loaded bounds, the loads at the loop's top level: the compiler pipelines them (num_stages)
        for n0 in range(s_lo, s_hi, BN):
            m_i, l_i, acc = _key_block(n0, s_hi, q, k_ptr, v_ptr, pt_ptr, slot, spt, skp, skh, svp, svh, h, d,
                                       d_ok, start, bidirectional, qpos, anchor, W, i, length, qk_scale,
                                       m_i, l_i, acc, BN, PAGE, HAS_WINDOW, PRECISION, INTERPRETED)

    if splits == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * sob + i[:, None] * sol + head[:, None] * soh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:   # partials [splits, B * HKV, L * G, D], (m, l) [splits, B * HKV, L * G, 2]
        row = (split * tl.num_programs(1) + pid_bh).to(tl.int64) * LG + r
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["L", "BHKV", "splits"])
def _split_combine_kernel(part_ptr, ml_ptr, out_ptr, sob, sol, soh, L, BHKV, splits, HKV: tl.constexpr,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr):
    """The splits in split order, whatever the rows; `splits` a value (one compiled variant for every
    count), in while loops (the interpreter takes no loaded bound in a range)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // HKV).to(tl.int64), (pid_bh % HKV).to(tl.int64)
    LG = L * G
    r = pid_m * BM + tl.arange(0, BM)
    row_ok = r < LG
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < D)
    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    s = 0
    while s < splits:
        row = (s * BHKV + pid_bh).to(tl.int64) * LG + r
        m = tl.maximum(m, tl.load(ml_ptr + row * 2, mask=row_ok, other=float("-inf")))
        s += 1
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BM, BLOCK_D), dtype=tl.float32)
    l = tl.zeros((BM,), dtype=tl.float32)
    s = 0
    while s < splits:
        row = (s * BHKV + pid_bh).to(tl.int64) * LG + r
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=row_ok, other=float("-inf")) - m)
        l += w * tl.load(ml_ptr + row * 2 + 1, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0)
        s += 1
    i = (r // G).to(tl.int64)
    head = h * G + (r % G)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + b * sob + i[:, None] * sol + head[:, None] * soh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mask)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
              lengths: torch.Tensor, causal: torch.Tensor, scale: float, window: int | None = None,
              keys: int | None = None, page_table: torch.Tensor | None = None, page_size: int | None = None,
              splits: int | None = None, tiles: tuple[int, int, int] | None = None,
              invariant: bool = False) -> torch.Tensor:
    """q [B, L, Hq, D]; k, v: a paged cache [rows, Hkv, D] read in place, position p of a slot at row
    page_table[slot, p // page_size] * page_size + p % page_size (without a page table: k, v are
    [slots, positions, Hkv, D], a slot's positions in order); slots, starts, lengths, causal [B] ->
    [B, L, Hq, D] in q's dtype. `window`: the sliding window W, None for none. `keys`: a host-side bound
    on start + length over the rows (it sizes the key splits, and the interpreter's trip count: keys past
    it are dropped there, read by the compiled loop; default: a slot's positions). `splits`: key splits
    (default: from the shapes alone, never from the metadata's values: no sync). `tiles`: (query rows,
    keys, warps[, pipeline stages]) per program instead of `_config`'s (the tests' small tiles; timings).
    `invariant`: each row's output independent of the other rows (batch-invariant mode)."""
    if page_table is None:   # a slot's positions in order: one page a slot
        page_size = k.shape[1]
        page_table = torch.arange(k.shape[0], dtype=torch.int64, device=k.device)[:, None]
        k, v = k.flatten(0, 1), v.flatten(0, 1)
    B, L, hq, D = q.shape
    hkv = k.shape[1]
    assert hq % hkv == 0 and k.shape[-1] == D and v.shape == k.shape, (q.shape, k.shape, v.shape)
    assert window is None or window >= 1, window
    assert D <= max(TILES), f"head dim {D} > {max(TILES)}"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    G = hq // hkv
    extent = keys if keys is not None else page_table.shape[1] * page_size
    BM, BN, warps, stages, S = _config(D, L * G, B, hkv, extent, q.device, invariant, q.element_size())
    BM, BN, warps, stages = (*tiles, 2)[:4] if tiles else (BM, BN, warps, stages)
    S = splits or S
    grid_m = triton.cdiv(L * G, BM)
    # the constexpr trip count of the interpreter's loop: iterations per split, rounded up to a power of two
    # (+ BN - 1: the range starts at a multiple of BN, up to BN - 1 keys early); 1 for the compiled loop,
    # which reads its range, so that growing key lengths compile no new variant
    iters = 1
    if INTERPRETED:
        iters = triton.next_power_of_2(triton.cdiv(triton.cdiv(extent + BN - 1, S), BN))
    out = torch.empty_like(q)
    if S > 1:
        part = torch.empty(S, B * hkv, L * G, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(S, B * hkv, L * G, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out   # unused
    block_d = _block_d(D)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _attn_kernel[(grid_m, B * hkv, S)](
        q, k, v, page_table, out, part, ml, slots, starts, lengths, causal,
        q.stride(0), q.stride(1), q.stride(2), page_table.stride(0), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), out.stride(2),
        L, window or 0, scale * LOG2E, HKV=hkv, G=G, D=D, BLOCK_D=block_d, BM=BM, BN=BN, PAGE=page_size,
        ITERS=iters, HAS_WINDOW=window is not None, PRECISION=precision, INTERPRETED=INTERPRETED,
        num_warps=warps, num_stages=stages)
    if S > 1:
        split_combine(part, ml, out)
    return out


def _block_d(d: int) -> int:
    """The head dim as a program holds it: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(d))


def combine_rows(d: int) -> int:
    """Rows a program of the split combine takes at head dim d: COMBINE_VALUES of fp32 accumulator."""
    return max(1, COMBINE_VALUES // _block_d(d))


def split_combine(part: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, rows: int | None = None,
                  warps: int = 4) -> None:
    """The key splits' partial states, part [S, B * Hkv, L * G, D] and their (m, l) [S, B * Hkv, L * G, 2],
    into out [B, L, Hq, D], in split order; `rows` a program (default combine_rows: a row's result does
    not depend on its tile, so any gives the same bits)."""
    splits, bhkv, lg, d = part.shape
    b, length, hq, _ = out.shape
    hkv = bhkv // b
    bm = rows or combine_rows(d)
    _split_combine_kernel[(triton.cdiv(lg, bm), bhkv)](
        part, ml, out, out.stride(0), out.stride(1), out.stride(2), length, bhkv, splits, HKV=hkv, G=hq // hkv,
        D=d, BLOCK_D=_block_d(d), BM=bm, num_warps=warps)
