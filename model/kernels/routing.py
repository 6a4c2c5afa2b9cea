"""DiffusionGemma's routing in triton: three launches where torch takes about twenty small kernels a layer.

  route       per token: softmax of the router's scores in fp32, the k largest (ties: the lower id),
              renormalised to sum 1, each times its expert's scale.
  sort_pairs  the pairs t * k + j sorted by expert, stably, in two launches: per-chunk counts, then each
              chunk's program sums the counts it needs itself, places its pairs and writes its share of
              the grouped kernel's tile map. No atomics: deterministic; each token's routing is its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 128          # pairs a program takes at a time when counting and placing
MAX_CHUNKS = 64    # chunks (programs) at most: each placing program reads every chunk's counts
ROWS = 32          # chunks (or tiles) a program takes at a time


@triton.jit
def _route_kernel(scores_ptr, scale_ptr, weights_ptr, ids_ptr, E, s_tok, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(scores_ptr + t * s_tok + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(e < E, p, -1.0)
    j = tl.arange(0, BLOCK_K)
    values = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), 0)
        values = tl.where(j == i, best, values)
        ids = tl.where(j == i, pick, ids)
        left = tl.where(e == pick, -1.0, left)
    keep = j < K
    weights = values / tl.sum(tl.where(keep, values, 0.0), 0)
    weights = weights * tl.load(scale_ptr + ids, mask=keep, other=0.0).to(tl.float32)
    tl.store(weights_ptr + t * K + j, weights, mask=keep)
    tl.store(ids_ptr + t * K + j, ids, mask=keep)


def route(scores: torch.Tensor, per_expert_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] -> weights [T, k] fp32, ids [T, k] int32 (largest first)."""
    t, e = scores.shape
    weights = torch.empty(t, k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=scores.device)
    _route_kernel[(t,)](scores, per_expert_scale, weights, ids, e, scores.stride(0), K=k,
                        BLOCK_K=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(e), num_warps=1)
    return weights, ids


@triton.jit(do_not_specialize=["P", "CHUNK"])
def _count_kernel(ids_ptr, counts_ptr, P, E, CHUNK, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    s0 = 0
    while s0 < CHUNK:
        i = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + i, mask=i < P, other=BLOCK_E)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
        s0 += SUB
    tl.store(counts_ptr + c * E + e, counts, mask=e < E)


@triton.jit(do_not_specialize=["P", "C", "MT", "CHUNK"])
def _place_kernel(ids_ptr, counts_ptr, token_ptr, slot_ptr, ends_ptr, tile_expert_ptr, tile_row_ptr, P, E, K, C, MT,
                  CHUNK, BM: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    r = tl.arange(0, ROWS)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)    # each expert's pairs in all chunks
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)   # ... in the chunks before this one
    c0 = 0
    while c0 < C:
        rows = c0 + r
        block = tl.load(counts_ptr + rows[:, None] * E + e[None, :], mask=(rows[:, None] < C) & (e[None, :] < E),
                        other=0)
        total += tl.sum(block, 0)
        before += tl.sum(tl.where(rows[:, None] < c, block, 0), 0)
        c0 += ROWS
    ends = tl.cumsum(total, 0)
    starts = ends - total
    if c == 0:
        tl.store(ends_ptr + e, ends, mask=e < E)
    if c < C:   # this chunk's pairs: after the lower experts', the earlier chunks' and its own earlier pairs
        base = starts + before
        s0 = 0
        while s0 < CHUNK:
            i = c * CHUNK + s0 + tl.arange(0, SUB)
            ids = tl.load(ids_ptr + i, mask=i < P, other=BLOCK_E)
            onehot = (ids[:, None] == e[None, :]).to(tl.int32)
            earlier = tl.cumsum(onehot, 0) - onehot
            place = tl.sum(onehot * (earlier + base[None, :]), 1)
            tl.store(slot_ptr + i, place.to(tl.int64), mask=i < P)
            tl.store(token_ptr + place, (i // K).to(tl.int64), mask=i < P)
            base += tl.sum(onehot, 0)
            s0 += SUB
    # tiles c * ROWS + r of the map: tile t belongs to the expert whose tiles end after it (E: a spare tile)
    per = (total + BM - 1) // BM
    tile_end = tl.cumsum(per, 0)
    first_tile = tile_end - per
    t = c * ROWS + r
    expert = tl.sum((tile_end[None, :] <= t[:, None]) & (e[None, :] < E), 1)
    mine = e[None, :] == tl.minimum(expert, E - 1)[:, None]
    row = tl.sum(tl.where(mine, starts[None, :] + (t[:, None] - first_tile[None, :]) * BM, 0), 1)
    tl.store(tile_expert_ptr + t, expert, mask=t < MT)
    tl.store(tile_row_ptr + t, row, mask=t < MT)


def sort_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids [T, k] -> (token [P]: the token of the i-th sorted pair, slot [P]: where pair t * k + j went,
    ends [E] int32: cumulative pairs per expert, tile_expert and tile_row [MT] int32: the expert (E for a
    spare tile) and first sorted row of each block_m-row tile, MT = ceil(P / block_m) + E)."""
    t, k = ids.shape
    p, e, dev = t * k, num_experts, ids.device
    flat = ids.reshape(-1).contiguous()
    # at most MAX_CHUNKS chunks, so the counts every placing program reads stay few. Sizes and counts are
    # runtime values, not specialized (while loops: the interpreter takes no loaded bound in a range), so
    # one variant of each kernel serves every token count: a prefill wider than any graph compiles nothing
    chunk = max(SUB, triton.next_power_of_2(triton.cdiv(p, MAX_CHUNKS)))
    chunks = triton.cdiv(p, chunk)
    block_e = triton.next_power_of_2(e)
    mt = triton.cdiv(p, block_m) + e
    counts = torch.empty(chunks, e, dtype=torch.int32, device=dev)
    ends = torch.empty(e, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(mt, dtype=torch.int32, device=dev)
    tile_row = torch.empty(mt, dtype=torch.int32, device=dev)
    token = torch.empty(p, dtype=torch.int64, device=dev)
    slot = torch.empty(p, dtype=torch.int64, device=dev)
    _count_kernel[(chunks,)](flat, counts, p, e, chunk, SUB=SUB, BLOCK_E=block_e, num_warps=4)
    _place_kernel[(max(chunks, triton.cdiv(mt, ROWS)),)](
        flat, counts, token, slot, ends, tile_expert, tile_row, p, e, k, chunks, mt, chunk, BM=block_m, SUB=SUB,
        ROWS=ROWS, BLOCK_E=block_e, num_warps=4)
    return token, slot, ends, tile_expert, tile_row
