"""The top-k / top-p filters' thresholds in triton (CUDA): model.sampling.filters' radix select, over
the raw logits' order-preserving keys.

The values filters are decided on, v = softcap(x) (DiffusionGemma) or x / T (masked diffusion), are a
non-decreasing function of the raw logit x, so the k-th largest v is v(the k-th largest x), and the
largest v-threshold reaching a top-p mass is v(the largest x-threshold reaching it). The search runs
over the keys of x in its own precision: 16 bits for bf16 logits (four passes of four bits), 32
otherwise. Keys are unsigned (the float's order-preserving bits with the sign bit flipped), so a key
minus a prefix never overflows int32 arithmetic. A pass is one launch over (row position, split of the
vocabulary slice): it first picks the digit the previous pass's totals decided (every split of a row
reads the same totals, so all agree), then totals its split's entries at or above 16 candidates
prefix + d << shift. Between passes, with tensor parallelism, one SUM all-reduce makes the totals global.
In all:

    top-k   BITS/4 count passes
    top-p   a log-normaliser pass over the top-k survivors, then BITS/4 mass passes
    finish  the thresholds v(x_t), -inf for rows asking neither

about ten launches whatever the batch asks; a row that asks for neither filter exits every pass at
once. The threshold is computed by `decided_value`, the code the statistics kernels
(model/kernels/vocab_stats.py) apply to every entry, so the entry x_t always passes its own threshold.

Why the passes are cheap (each should cost little more than reading the split once):
  - a count pass does not compare every entry with 16 candidates: it bins each entry by its digit,
    (key - prefix) >> shift clamped to "above" (bin 0: below the prefix or past the slice), and takes
    one 32-bin tl.histogram per tile (warp ballots on the GPU); the candidates' counts are the
    histogram's suffix sums, once per program.
  - a mass pass needs a sum of probabilities per digit, which a histogram cannot weight: it
    accumulates a [16, BLOCK] tile, candidates along the first axis, so that each lane holds all 16
    candidates of its own entries and the per-entry work (tanh, exp, the key) is done once per entry
    (with the candidates along the last axis, triton spreads them over lanes and every lane redoes the
    per-entry work of the entries it shares).
  - passes skip a tile from its maximum logit alone: an entry counts in no candidate below the pass's
    prefix, and no entry of a tile survives top-k when its largest value does not (v is non-decreasing).
  - and they know that maximum before reading the tile: each CACHE_TILE tile's largest logit is kept by
    the row's first read of the logits (a read of maxima alone for rows asking top-k, the log-normaliser
    pass for rows asking top-p alone), and later passes read a split's maxima in one load and a tile only
    where it reaches (a count pass, of a count tile that reaches, only the cached tiles that do: masked
    lanes load nothing), so a skipped tile costs neither its read nor the latency of a load (per rank:
    each keeps the maxima of its own slice).
  - top-k passes skip from the start, not only once the prefix has narrowed: the k-th largest of a
    row's tile maxima, L, is a lower bound of its k-th largest logit (the k largest maxima are k
    entries), so tiles whose maximum is below L hold no survivor. Skipping them undercounts only
    candidates at or below L, which reach k anyway (every entry >= L is counted), so every pass picks
    the digit it would have picked; with tensor parallelism each rank's own L bounds the global k-th
    the same way. For k = 40 this leaves about 40 of a row's 512 tiles (262,144 entries) to read after
    its first read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from model.kernels.launch import INTERPRETED
from model.parallel.group import TPGroup
from model.sampling.filters import CANDIDATES

SPLIT = 16384        # vocabulary entries per program
COUNT_BLOCK = 512    # a count pass's tile: one histogram per tile (2048 was slower on an H100: tiles skip less)
MASS_BLOCK = 512     # a mass pass's tile: its [16, MASS_BLOCK] fp32 totals stay in registers
CACHE_TILE = 512     # entries a cached maximum covers (at most MASS_BLOCK; 256 was slower on an H100)
NUM_WARPS = 4
HISTOGRAM = True     # count passes by tl.histogram (False: by 16 comparisons an entry; the same totals)
# the pass kinds (constexprs: kernels read them)
COUNT, LOG_NORM, MASS, KEY_MASS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
BINS = 32            # a count histogram's bins: below, the 16 digits, above, unused


@triton.jit
def tanh(y, INTERPRETED: tl.constexpr):
    """tanh in fp32: libdevice's on the GPU; in the interpreter, to a few ulps, its odd Taylor polynomial
    near 0 and (1 - e^-2|y|) / (1 + e^-2|y|) elsewhere."""
    if not INTERPRETED:
        return libdevice.tanh(y)
    a = tl.abs(y)
    y2 = y * y
    near = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.0625, near, tl.where(y < 0, -far, far))


@triton.jit
def decided_value(x, t_eff, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """The value a filter is decided on, of raw logits x (fp32): softcap(x) [/ T]."""
    u = x
    if HAS_SOFTCAP:
        u = tanh(u * inv_softcap, INTERPRETED) * softcap
    if ON_SCALED:
        u = tl.div_rn(u, t_eff)
    return u


@triton.jit
def _logit_keys(x, BITS: tl.constexpr):
    """Order-preserving uint32 keys in [0, 2^BITS) of fp32 x in the logits' own BITS-bit precision (bf16
    values in fp32 are their 16 bits shifted up), -0 as +0: the signed order of the float's bits, its
    sign bit flipped."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = tl.where(ordered == -1, 0, ordered)
    return (ordered.to(tl.uint32, bitcast=True) ^ 0x80000000) >> (32 - BITS)


@triton.jit
def _key_logit(key, BITS: tl.constexpr):
    """The fp32 logit of a key of _logit_keys (held in int64)."""
    ordered = ((key - (1 << (BITS - 1))) << (32 - BITS)).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _chosen(totals_ptr, n, splits, target, NC: tl.constexpr, SPLITS_P2: tl.constexpr, past=0.0):
    """The digit a pass's totals decide for row position n: the largest candidate whose total (over the
    splits, plus `past`, what every candidate holds besides) reaches the target, 0 if none; and whether
    candidate 0 (everything above the prefix) did."""
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, NC)
    parts = tl.load(totals_ptr + (n * splits + s[:, None]) * NC + d[None, :], mask=s[:, None] < splits, other=0.0)
    ok = past + tl.sum(parts, 0) >= target
    return tl.maximum(tl.sum(ok.to(tl.int32), 0) - 1, 0), tl.sum(tl.where(d == 0, ok.to(tl.int32), 0), 0) > 0


@triton.jit
def _reaches(top_x, low, lowest, thr, t_eff, softcap, inv_softcap, MODE: tl.constexpr, BITS: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr, INTERPRETED: tl.constexpr):
    """Whether a tile whose largest logit is top_x (a scalar or a vector of tiles) may hold an entry the
    pass counts: at or above the prefix (pass 0's prefix is 0: every tile), not below the top-k bound
    L (COUNT: -inf unless known), and surviving top-k (LOG_NORM, MASS: thr = v(-inf) where no top-k)."""
    ok = (_logit_keys(top_x, BITS) >= low) & (top_x >= lowest)
    if MODE != COUNT:
        ok = ok & (decided_value(top_x, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED) >= thr)
    return ok


@triton.jit
def _tile_max_kernel(x_ptr, top_k_ptr, tile_max_ptr, P, V, splits, SPLIT_SIZE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr):
    """tile_max[n, split, t]: the largest logit of the split's t-th TILE-entry tile (-inf past the slice),
    for the rows asking top-k (a read of the logits and nothing else: their first)."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(top_k_ptr + n // P) > 0:
        SUB: tl.constexpr = BLOCK_SIZE // TILE
        row_ptr = x_ptr + n.to(tl.int64) * V
        cache = tile_max_ptr + (n.to(tl.int64) * splits + split) * TILES
        sub = tl.arange(0, SUB)
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = split * SPLIT_SIZE + off + tl.arange(0, BLOCK_SIZE)
            x = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            first = off // TILE
            tl.store(cache + first + sub, tl.max(tl.reshape(x, (SUB, TILE)), 1), mask=first + sub < TILES)


# the pass and its digit's shift are runtime values (one compiled kernel per mode serves every pass: a
# cold start compiles 3 filter kernels a flag set, not 9 for bf16 logits and 17 for fp32), unspecialized
# (triton would otherwise compile apart the values equal to 1 or divisible by 16)
@triton.jit(do_not_specialize=["PASS", "SHIFT"])
def _filter_pass_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, prev_ptr, prefix_ptr, out_ptr, xk_ptr, norm_ptr,
                        tile_max_ptr, bound_ptr, P, V, splits, norm_splits, softcap, inv_softcap, PASS, SHIFT,
                        MODE: tl.constexpr, BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        ON_SCALED: tl.constexpr, INTERPRETED: tl.constexpr, NC: tl.constexpr,
                        SPLITS_P2: tl.constexpr, NORM_SPLITS_P2: tl.constexpr, SPLIT_SIZE: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
                        TILES_P2: tl.constexpr, HISTOGRAM: tl.constexpr, BINS: tl.constexpr):
    """COUNT pass PASS: out[n, split, d] = entries with key >= prefix + d << shift (undercounted only at
    candidates <= bound[n], the top-k bound L); LOG_NORM: out[n, split, 0:2] = (max, sum exp(v - max))
    of the top-k survivors' values (and xk[n] = the top-k threshold's logit); MASS pass PASS: out[n,
    split, d] = their probability mass at keys >= prefix + d << shift; KEY_MASS (the last mass pass, whose
    digits are single keys): out[n, split, d] = their mass at keys in [prefix + d, prefix + 16), a count of
    each key times its probability (the mass past prefix + 16 is the earlier passes': _mass_past).
    prev: the previous pass's totals (PASS > 0); prefix[PASS - 1] the prefix they were counted at.
    tile_max[n, split, t]: the largest logit of the split's t-th TILE-entry tile (-inf past the slice),
    written by _tile_max_kernel for rows asking top-k and by LOG_NORM for the others, read by every
    other pass; BLOCK_SIZE is a multiple of TILE."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    row = n // P
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    active = (k > 0) if MODE == COUNT else (p < 1)
    d = tl.arange(0, NC)
    bins = tl.arange(0, BINS)
    hist = tl.zeros((BINS,), dtype=tl.int32)
    # per-lane totals [candidate, entry], summed across lanes once after the loop
    acc = tl.zeros((NC, BLOCK_SIZE), dtype=tl.float32)
    m = tl.full((), -float("inf"), tl.float32)
    z = tl.zeros((), tl.float32)
    weights = tl.zeros((NC,), tl.float32)
    if active:
        temp = tl.load(temp_ptr + row)
        t_eff = tl.where(temp > 0, temp, 1.0)
        if MODE == COUNT:
            target = k.to(tl.float32)
        else:
            target = p
        prefix = tl.zeros((), tl.int64)
        if PASS > 0:
            digit, _ = _chosen(prev_ptr, n, splits, target, NC, SPLITS_P2)
            prefix = tl.load(prefix_ptr + (PASS - 1) * tl.num_programs(0) + n)
            prefix += digit.to(tl.int64) << (SHIFT + 4).to(tl.int64)
        if split == 0:
            tl.store(prefix_ptr + PASS * tl.num_programs(0) + n, prefix)
        low = prefix.to(tl.uint32)
        thr = -float("inf")
        lowest = -float("inf")
        if MODE == COUNT:
            lowest = tl.load(bound_ptr + n)
        else:
            thr = decided_value(tl.load(xk_ptr + n), t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
        if MODE == MASS or MODE == KEY_MASS:
            s = tl.arange(0, NORM_SPLITS_P2)
            inside_s = s < norm_splits
            ms = tl.load(norm_ptr + (n * norm_splits + s) * NC, mask=inside_s, other=-float("inf"))
            zs = tl.load(norm_ptr + (n * norm_splits + s) * NC + 1, mask=inside_s, other=0.0)
            top = tl.max(ms, 0)
            safe = tl.where(top == -float("inf"), 0.0, top)
            norm = safe + tl.log(tl.sum(tl.where(zs > 0, zs * tl.exp(ms - safe), 0.0), 0))
        row_ptr = x_ptr + n.to(tl.int64) * V
        start = split * SPLIT_SIZE
        if MODE == LOG_NORM:
            fill = k <= 0   # the row's first read (no _tile_max_kernel for it): every tile, keeping maxima
        else:
            fill = False
        SUB: tl.constexpr = BLOCK_SIZE // TILE
        cache = tile_max_ptr + (n.to(tl.int64) * splits + split) * TILES
        tiles = tl.arange(0, TILES_P2)
        sub = tl.arange(0, SUB)
        if fill:
            cached = tl.full((TILES_P2,), -float("inf"), tl.float32)
        else:   # the split's maxima at once: one load a program, not one a tile
            cached = tl.load(cache + tiles, mask=tiles < TILES, other=-float("inf"))
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = start + off + tl.arange(0, BLOCK_SIZE)
            inside = cols < V
            first = off // TILE
            if fill:
                x = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
                tops = tl.max(tl.reshape(x, (SUB, TILE)), 1)
                tl.store(cache + first + sub, tops, mask=first + sub < TILES)
                top_x = tl.max(tops, 0)
            else:
                x = tl.full((BLOCK_SIZE,), -float("inf"), tl.float32)   # read below, where the tile reaches
                top_x = tl.max(tl.where((tiles >= first) & (tiles < first + SUB), cached, -float("inf")), 0)
            if _reaches(top_x, low, lowest, thr, t_eff, softcap, inv_softcap, MODE, BITS, HAS_SOFTCAP, ON_SCALED,
                        INTERPRETED):
                if not fill:
                    x = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
                if MODE == LOG_NORM:
                    v = decided_value(x, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
                    v = tl.where(inside & (v >= thr), v, -float("inf"))
                    new_m = tl.maximum(m, tl.max(v, 0))
                    safe_m = tl.where(new_m == -float("inf"), 0.0, new_m)
                    z = z * tl.exp(m - safe_m) + tl.sum(tl.exp(v - safe_m), 0)
                    m = new_m
                else:
                    key = _logit_keys(x, BITS)
                    at = key >= low
                    # the digit, 16 for keys past the pass's range (they count in every candidate)
                    digits = tl.minimum((key - low) >> SHIFT.to(tl.uint32), 16).to(tl.int32)
                    if MODE == COUNT or MODE == KEY_MASS:
                        binned = tl.where(at & inside, digits + 1, 0)   # bin 0: counted in no candidate
                        if HISTOGRAM or MODE == KEY_MASS:
                            hist += tl.histogram(binned, BINS)
                        else:
                            acc += (d[:, None] < binned[None, :]).to(tl.float32)
                    else:
                        v = decided_value(x, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
                        mass = tl.where(at & inside & (v >= thr), tl.exp(v - norm), 0.0)
                        acc += tl.where(d[:, None] <= digits[None, :], mass[None, :], 0.0)
        if MODE == KEY_MASS:   # a digit's key is one value: its probability, 0 where top-k drops it
            keys = prefix + d
            key_v = decided_value(_key_logit(keys, BITS), t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED,
                                  INTERPRETED)
            weights = tl.where((keys < (1 << BITS)) & (key_v >= thr), tl.exp(key_v - norm), 0.0)
    out = (n * splits + split) * NC
    if MODE == KEY_MASS:   # the keys' counts (bins 1..16) times their probabilities, summed from each d up
        counts = tl.sum(tl.where(bins[None, :] == d[:, None] + 1, hist[None, :], 0), 1)
        key_mass = counts.to(tl.float32) * weights
        tl.store(out_ptr + out + d, tl.sum(tl.where(d[None, :] >= d[:, None], key_mass[None, :], 0.0), 1))
    elif MODE == LOG_NORM:
        tl.store(out_ptr + out + d, tl.where(d == 0, m, tl.where(d == 1, z, 0.0)))
    elif MODE == COUNT and HISTOGRAM:   # candidate d counts the bins past d: the suffix sums
        tl.store(out_ptr + out + d, tl.sum(tl.where(bins[None, :] > d[:, None], hist[None, :], 0), 1).to(tl.float32))
    else:
        tl.store(out_ptr + out + d, tl.sum(acc, 1))


@triton.jit
def _top_k_logit_kernel(top_k_ptr, totals_ptr, first_ptr, prefix_ptr, xk_ptr, P, splits, last,
                        BITS: tl.constexpr, NC: tl.constexpr, SPLITS_P2: tl.constexpr):
    """xk[n]: the k-th largest logit of row position n (-inf where the row asks no top-k, or more than the
    vocabulary), from the last count pass."""
    n = tl.program_id(0)
    k = tl.load(top_k_ptr + n // P)
    digit, _ = _chosen(totals_ptr, n, splits, k.to(tl.float32), NC, SPLITS_P2)
    _, reached = _chosen(first_ptr, n, splits, k.to(tl.float32), NC, SPLITS_P2)   # k entries at all
    key = tl.load(prefix_ptr + last * tl.num_programs(0) + n) + digit.to(tl.int64)
    tl.store(xk_ptr + n, tl.where((k > 0) & reached, _key_logit(key, BITS), -float("inf")))


@triton.jit
def _mass_past(masses_ptr, prefix_ptr, n, splits, BITS: tl.constexpr, NC: tl.constexpr, SPLITS_P2: tl.constexpr):
    """The mass at keys past the last (KEY_MASS) pass's 16, prefix + 16 and up, which its totals leave out:
    the total of the latest weighted pass whose digit was not its largest, at the candidate after that
    digit (the passes' prefixes give their digits); 0 where every pass took its largest digit."""
    RP = tl.num_programs(0)
    s = tl.arange(0, SPLITS_P2)
    past = tl.zeros((), tl.float32)
    for j in tl.static_range(BITS // 4 - 1):   # later passes override earlier ones
        digit = (tl.load(prefix_ptr + (j + 1) * RP + n) - tl.load(prefix_ptr + j * RP + n)) >> (BITS - 4 * (j + 1))
        after = tl.minimum(digit + 1, NC - 1).to(tl.int32)
        parts = tl.load(masses_ptr + ((j * RP + n) * splits + s) * NC + after, mask=s < splits, other=0.0)
        past = tl.where(digit < NC - 1, tl.sum(parts, 0), past)
    return past


@triton.jit
def _finish_kernel(temp_ptr, top_p_ptr, xk_ptr, totals_ptr, first_ptr, prefix_ptr, out_ptr, P, splits, last,
                   softcap, inv_softcap, BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr,
                   INTERPRETED: tl.constexpr, NC: tl.constexpr, SPLITS_P2: tl.constexpr):
    """out[n]: the threshold v(max(top-k logit, top-p logit)), -inf for a row asking neither filter."""
    n = tl.program_id(0)
    row = n // P
    p = tl.load(top_p_ptr + row)
    temp = tl.load(temp_ptr + row)
    t_eff = tl.where(temp > 0, temp, 1.0)
    raw = tl.load(xk_ptr + n)
    if p < 1:
        past = _mass_past(first_ptr, prefix_ptr, n, splits, BITS, NC, SPLITS_P2)
        digit, _ = _chosen(totals_ptr, n, splits, p, NC, SPLITS_P2, past)
        _, reached = _chosen(first_ptr, n, splits, p, NC, SPLITS_P2)   # the whole mass reaches p
        key = tl.load(prefix_ptr + last * tl.num_programs(0) + n) + digit.to(tl.int64)
        raw = tl.where(reached, tl.maximum(raw, _key_logit(key, BITS)), raw)
    v = decided_value(raw, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
    tl.store(out_ptr + n, tl.where(raw == -float("inf"), -float("inf"), v))


def softcap_operands(softcap: float | None) -> tuple[float, float]:
    """(c, 1 / c) as the kernels take them, 1 / c rounded here on the host as model.sampling.filters'
    torch softcap multiplies by it; (1, 1) without a softcap (the kernels skip it then)."""
    cap = float(softcap or 1.0)
    return cap, 1.0 / cap


def top_k_bound(tile_max: torch.Tensor, top_k: torch.Tensor, P: int) -> torch.Tensor:
    """[R * P]: L, the k-th largest of each row position's tile maxima [R * P, splits, tiles] (its own
    rank's), a lower bound of its k-th largest logit; -inf where the row asks no top-k or k exceeds its
    tiles. Maxima of rows asking no top-k were never written: whatever they hold is not read."""
    ranked = tile_max.flatten(1).sort(dim=1, descending=True).values
    k = top_k.repeat_interleave(P).view(-1, 1)
    kth = ranked.gather(1, (k - 1).clamp(0, ranked.shape[1] - 1)).squeeze(1)
    return torch.where((k.squeeze(1) > 0) & (k.squeeze(1) <= ranked.shape[1]), kth, -torch.inf)


def triton_threshold(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     vocab_start: int, tp: TPGroup, *, softcap: float | None = None,
                     on_scaled: bool = True) -> torch.Tensor:
    """model.sampling.filters.torch_threshold's contract on CUDA (and the interpreter)."""
    R, P, V = x.shape
    RP, dev = R * P, x.device
    x = x.contiguous()
    bits = 16 if x.dtype == torch.bfloat16 else 32
    passes = bits // 4
    splits = triton.cdiv(V, SPLIT)
    temp = temperature.float().contiguous()
    top_k, top_p = top_k.contiguous(), top_p.float().contiguous()
    flags = dict(BITS=bits, HAS_SOFTCAP=softcap is not None, ON_SCALED=on_scaled, INTERPRETED=INTERPRETED,
                 NC=CANDIDATES, SPLITS_P2=triton.next_power_of_2(splits))
    cap, inv_cap = softcap_operands(softcap)
    counts = torch.empty(passes, RP, splits, CANDIDATES, device=dev)
    masses = torch.empty_like(counts)
    norm = torch.empty(RP, splits, CANDIDATES, device=dev)
    prefix_k = torch.empty(passes, RP, dtype=torch.int64, device=dev)
    prefix_p = torch.empty_like(prefix_k)
    xk = torch.empty(RP, device=dev)
    width = min(SPLIT, V)
    count_block, mass_block = (min(b, triton.next_power_of_2(width)) for b in (COUNT_BLOCK, MASS_BLOCK))
    tile = min(CACHE_TILE, mass_block)
    # a count or mass tile is whole cached tiles (the maximum of their maxima is its own), and no tile
    # straddles two splits (a split's maxima cover its tiles alone)
    assert count_block % tile == 0 and mass_block % tile == 0 and (splits == 1 or width % count_block == 0), (
        SPLIT, COUNT_BLOCK, MASS_BLOCK, CACHE_TILE)
    tiles = triton.cdiv(width, tile)
    tile_max = torch.empty(RP, splits, tiles, device=dev)   # each row's first read fills what later ones read
    _tile_max_kernel[(RP, splits)](x, top_k, tile_max, P, V, splits, SPLIT_SIZE=width, BLOCK_SIZE=count_block,
                                   TILE=tile, TILES=tiles, num_warps=NUM_WARPS)
    bound = top_k_bound(tile_max, top_k, P)

    def launch(mode, i, prev, prefix, out, norm_in, norm_splits, block):
        _filter_pass_kernel[(RP, splits)](
            x, temp, top_k, top_p, prev, prefix, out, xk, norm_in, tile_max, bound, P, V, splits, norm_splits, cap,
            inv_cap, i, bits - 4 * (i + 1), MODE=mode.value, NORM_SPLITS_P2=triton.next_power_of_2(norm_splits),
            SPLIT_SIZE=width, BLOCK_SIZE=block, TILE=tile, TILES=tiles, TILES_P2=triton.next_power_of_2(tiles),
            HISTOGRAM=HISTOGRAM, BINS=BINS, num_warps=NUM_WARPS, **flags)

    for i in range(passes):
        launch(COUNT, i, counts[i - 1] if i else counts[0], prefix_k, counts[i], norm, 1, count_block)
        tp.all_reduce(counts[i])   # the counts over ranks
    _top_k_logit_kernel[(RP,)](top_k, counts[-1], counts[0], prefix_k, xk, P, splits, passes - 1, BITS=bits,
                               NC=CANDIDATES, SPLITS_P2=triton.next_power_of_2(splits))
    launch(LOG_NORM, 0, counts[0], prefix_p, norm, norm, 1, mass_block)
    norm_in, norm_splits = norm, splits
    if tp.is_parallel:   # (max, sum) pairs combine by rescaling, not by a plain sum: over the ranks here
        m = tp.all_reduce(norm[..., 0].amax(1), torch.distributed.ReduceOp.MAX)
        safe = torch.where(torch.isfinite(m), m, 0.0)
        z = tp.all_reduce((norm[..., 1] * torch.exp(norm[..., 0] - safe[:, None])).nan_to_num(0.0).sum(1))
        norm_in, norm_splits = torch.stack([m, z], -1).reshape(RP, 1, 2), 1
        norm_in = torch.nn.functional.pad(norm_in, (0, CANDIDATES - 2))
    for i in range(passes):
        last = i == passes - 1   # its digits are single keys: counted, and weighed once a key
        launch(KEY_MASS if last else MASS, i, masses[i - 1] if i else masses[0], prefix_p, masses[i], norm_in,
               norm_splits, count_block if last else mass_block)
        tp.all_reduce(masses[i])   # the masses over ranks
    out = torch.empty(RP, dtype=torch.float32, device=dev)
    _finish_kernel[(RP,)](temp, top_p, xk, masses[-1], masses[0], prefix_p, out, P, splits, passes - 1, cap, inv_cap,
                          **flags)
    return out.view(R, P)
