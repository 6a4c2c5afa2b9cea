"""The top-k / top-p filters' thresholds in triton (CUDA): model.sampling.filters' radix select, run over
the raw logits' order-preserving keys (16 bits for bf16, 32 for fp32) instead of the decided values',
which the values' non-decreasing map from the logits makes equivalent.

A first launch reads each filtered row's tile maxima; then count passes find the top-k logit and as many
mass passes the top-p one, each totalling 16 candidate digits per split (one SUM all-reduce between
passes under tensor parallelism), and a finish maps them to thresholds with `decided_value`, the code
the statistics kernels apply to every entry, so an entry always passes its own threshold. Why each pass
costs about one read of what it reaches (histograms, tiles skipped from their maxima): docs/kernels.md.
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
# the pass kinds (constexprs: kernels read them)
COUNT, MASS, KEY_MASS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
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
def capped(u, softcap, inv_softcap, INTERPRETED: tl.constexpr):
    """softcap * tanh(u / softcap), -inf kept (a token a grammar refuses stays impossible, docs/spec.md 12)."""
    return tl.where(u == -float("inf"), u, tanh(u * inv_softcap, INTERPRETED) * softcap)


@triton.jit
def decided_value(x, t_eff, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """The value a filter is decided on, of raw logits x (fp32): softcap(x) [/ T]."""
    u = x
    if HAS_SOFTCAP:
        u = capped(u, softcap, inv_softcap, INTERPRETED)
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
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    # a negative value's low 32 - BITS bits were flipped to ones, which the key dropped: zeros again
    return (bits & -(1 << (32 - BITS))).to(tl.float32, bitcast=True)


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
    L (COUNT: -inf unless known), and surviving top-k (MASS, KEY_MASS: thr = v(-inf) where no top-k)."""
    ok = (_logit_keys(top_x, BITS) >= low) & (top_x >= lowest)
    if MODE != COUNT:
        ok = ok & (decided_value(top_x, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED) >= thr)
    return ok


@triton.jit
def _tile_max_kernel(x_ptr, top_k_ptr, top_p_ptr, tile_max_ptr, P, V, splits, SPLIT_SIZE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr):
    """tile_max[n, split, t]: the largest logit of the split's t-th TILE-entry tile (-inf past the slice),
    for the rows asking a filter (a read of the logits and nothing else: their first)."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    if (tl.load(top_k_ptr + n // P) > 0) | (tl.load(top_p_ptr + n // P) < 1):
        SUB: tl.constexpr = BLOCK_SIZE // TILE
        row_ptr = x_ptr + n.to(tl.int64) * V
        cache = tile_max_ptr + (n.to(tl.int64) * splits + split) * TILES
        sub = tl.arange(0, SUB)
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = split * SPLIT_SIZE + off + tl.arange(0, BLOCK_SIZE)
            x = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            first = off // TILE
            tl.store(cache + first + sub, tl.max(tl.reshape(x, (SUB, TILE)), 1), mask=first + sub < TILES)


@triton.jit
def _top_k_bound_kernel(tile_max_ptr, top_k_ptr, bound_ptr, P, COUNT: tl.constexpr, COUNT_P2: tl.constexpr):
    """bound[n]: the k-th largest of row position n's COUNT tile maxima, ties counted: the largest key t
    with count(keys >= t) >= k, found a bit at a time from the top (a bisection on the maxima's 32-bit
    keys, no sort); -inf where the row asks no top-k or k exceeds COUNT."""
    n = tl.program_id(0)
    k = tl.load(top_k_ptr + n // P)
    i = tl.arange(0, COUNT_P2)
    inside = i < COUNT
    keys = _logit_keys(tl.load(tile_max_ptr + n.to(tl.int64) * COUNT + i, mask=inside, other=0.0), 32).to(tl.int64)
    t = tl.zeros((), tl.int64)
    for j in tl.static_range(32):   # bit 31 - j: kept where the keys at or above it still number k
        candidate = t + (1 << (31 - j))
        t = tl.where(tl.sum((inside & (keys >= candidate)).to(tl.int32), 0) >= k, candidate, t)
    tl.store(bound_ptr + n, tl.where((k > 0) & (k <= COUNT), _key_logit(t, 32), -float("inf")))


# the pass and its digit's shift are runtime values (one compiled kernel per mode serves every pass: a
# cold start compiles 3 filter kernels a flag set, not 9 for bf16 logits and 17 for fp32), unspecialized
# (triton would otherwise compile apart the values equal to 1 or divisible by 16)
@triton.jit(do_not_specialize=["PASS", "SHIFT"])
def _filter_pass_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, prev_ptr, prefix_ptr, out_ptr, xk_ptr, ref_ptr,
                        lognorm_ptr, tile_max_ptr, bound_ptr, P, V, splits, softcap, inv_softcap, PASS, SHIFT,
                        MODE: tl.constexpr, BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        ON_SCALED: tl.constexpr, INTERPRETED: tl.constexpr, NC: tl.constexpr,
                        SPLITS_P2: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        TILE: tl.constexpr, TILES: tl.constexpr, TILES_P2: tl.constexpr, BINS: tl.constexpr):
    """COUNT pass PASS: out[n, split, d] = entries with key >= prefix + d << shift (undercounted only at
    candidates <= bound[n], the top-k bound L). MASS pass PASS: out[n, split, d] = the top-k survivors'
    probability mass at keys >= prefix + d << shift; pass 0, before the normaliser is known, sums
    exp(v - ref[n, split]) instead, ref being the split's largest surviving value (written, -inf where
    none survives; its candidate 0 is every survivor: the split's sum of the normaliser), and later ones
    exp(v - lognorm[n]). KEY_MASS (the last mass pass, whose digits are single keys): out[n, split, d] =
    the mass at keys in [prefix + d, prefix + 16), a count of each key times its probability (the mass
    past prefix + 16 is the earlier passes': _mass_past).
    prev: the previous pass's totals (PASS > 0); prefix[PASS - 1] the prefix they were counted at.
    tile_max[n, split, t]: the largest logit of the split's t-th TILE-entry tile (-inf past the slice),
    written by _tile_max_kernel for every row asking a filter; BLOCK_SIZE is a multiple of TILE."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    row = n // P
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    active = (k > 0) if MODE == COUNT else (p < 1)
    d = tl.arange(0, NC)
    bins = tl.arange(0, BINS)
    hist = tl.zeros((BINS,), dtype=tl.int32)
    # a mass pass's per-lane totals [candidate, entry], summed across lanes once after the loop
    acc = tl.zeros((NC, BLOCK_SIZE), dtype=tl.float32)
    weights = tl.zeros((NC,), tl.float32)
    ref = tl.full((), -float("inf"), tl.float32)
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
        cache = tile_max_ptr + (n.to(tl.int64) * splits + split) * TILES
        tiles = tl.arange(0, TILES_P2)
        thr = -float("inf")
        lowest = -float("inf")
        log_scale = tl.zeros((), tl.float32)   # probabilities are exp(v - log_scale)
        if MODE == COUNT:
            lowest = tl.load(bound_ptr + n)
        else:
            thr = decided_value(tl.load(xk_ptr + n), t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
            if PASS == 0:   # v is non-decreasing: the split's largest value is v(its largest logit)
                top_x = tl.max(tl.load(cache + tiles, mask=tiles < TILES, other=-float("inf")), 0)
                top_v = decided_value(top_x, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
                ref = tl.where(top_v >= thr, top_v, -float("inf"))
                log_scale = tl.where(ref == -float("inf"), 0.0, ref)   # no survivor: no tile reaches either
            else:
                log_scale = tl.load(lognorm_ptr + n)
        row_ptr = x_ptr + n.to(tl.int64) * V
        start = split * SPLIT_SIZE
        SUB: tl.constexpr = BLOCK_SIZE // TILE
        sub = tl.arange(0, SUB)
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = start + off + tl.arange(0, BLOCK_SIZE)
            inside = cols < V
            first = off // TILE
            # the tile's own maxima, loaded as it comes (not the split's at once, reduced for every tile)
            top_x = tl.max(tl.load(cache + first + sub, mask=first + sub < TILES, other=-float("inf")), 0)
            if _reaches(top_x, low, lowest, thr, t_eff, softcap, inv_softcap, MODE, BITS, HAS_SOFTCAP, ON_SCALED,
                        INTERPRETED):
                x = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
                key = _logit_keys(x, BITS)
                at = key >= low
                # the digit, 16 for keys past the pass's range (they count in every candidate)
                digits = tl.minimum((key - low) >> SHIFT.to(tl.uint32), 16).to(tl.int32)
                if MODE == MASS:
                    v = decided_value(x, t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
                    mass = tl.where(at & inside & (v >= thr), tl.exp(v - log_scale), 0.0)
                    acc += tl.where(d[:, None] <= digits[None, :], mass[None, :], 0.0)
                else:
                    binned = tl.where(at & inside, digits + 1, 0)   # bin 0: counted in no candidate
                    hist += tl.histogram(binned, BINS)
        if MODE == KEY_MASS:   # a digit's key is one value: its probability, 0 where top-k drops it
            # (the last prefix ends in 4 zero bits, so prefix + d is a key for every d)
            key_v = decided_value(_key_logit(prefix + d, BITS), t_eff, softcap, inv_softcap, HAS_SOFTCAP, ON_SCALED,
                                  INTERPRETED)
            weights = tl.where(key_v >= thr, tl.exp(key_v - log_scale), 0.0)
    out = (n * splits + split) * NC
    if MODE == MASS:
        if PASS == 0:
            tl.store(ref_ptr + n * splits + split, ref)
    if MODE == KEY_MASS:   # the keys' counts (bins 1..16) times their probabilities, summed from each d up
        counts = tl.sum(tl.where(bins[None, :] == d[:, None] + 1, hist[None, :], 0), 1)
        key_mass = counts.to(tl.float32) * weights
        tl.store(out_ptr + out + d, tl.sum(tl.where(d[None, :] >= d[:, None], key_mass[None, :], 0.0), 1))
    elif MODE == COUNT:   # candidate d counts the bins past d: the suffix sums
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
    tiles. Maxima of rows asking no filter were never written: whatever they hold is not read."""
    RP, count = tile_max.shape[0], tile_max[0].numel()
    bound = torch.empty(RP, dtype=torch.float32, device=tile_max.device)
    _top_k_bound_kernel[(RP,)](tile_max.contiguous(), top_k.contiguous(), bound, P, COUNT=count,
                               COUNT_P2=triton.next_power_of_2(count))
    return bound


def normalise_first_pass(first: torch.Tensor, ref: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The top-p log-normaliser log sum exp(v) over the top-k survivors [R * P], from mass pass 0's sums
    relative to each split's largest survivor, ref [R * P, splits] (-inf where none): candidate 0 counts
    every survivor, so first[..., 0] is the split's sum exp(v - ref). Those pairs combine by rescaling to
    the largest ref (over the ranks too: a MAX, then a SUM all-reduce); first becomes relative to the
    normaliser in place, on this rank's splits (its all-reduce follows)."""
    top = ref.amax(1)
    if tp.is_parallel:
        top = tp.all_reduce(top, torch.distributed.ReduceOp.MAX)
    safe = torch.where(torch.isfinite(top), top, 0.0)
    total = (first[..., 0] * torch.exp(ref - safe[:, None])).nan_to_num(0.0).sum(1)
    if tp.is_parallel:
        total = tp.all_reduce(total)
    lognorm = safe + torch.log(total)
    first.mul_(torch.exp(ref - lognorm[:, None]).nan_to_num(0.0, posinf=0.0).unsqueeze(-1))
    return lognorm


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
    tile_max = torch.empty(RP, splits, tiles, device=dev)   # the first read of every filtered row
    _tile_max_kernel[(RP, splits)](x, top_k, top_p, tile_max, P, V, splits, SPLIT_SIZE=width, BLOCK_SIZE=count_block,
                                   TILE=tile, TILES=tiles, num_warps=NUM_WARPS)
    bound = top_k_bound(tile_max, top_k, P)
    ref = torch.empty(RP, splits, device=dev)
    lognorm = torch.empty(RP, device=dev)

    def launch(mode, i, prev, prefix, out, block):
        _filter_pass_kernel[(RP, splits)](
            x, temp, top_k, top_p, prev, prefix, out, xk, ref, lognorm, tile_max, bound, P, V, splits, cap, inv_cap,
            i, bits - 4 * (i + 1), MODE=mode.value, SPLIT_SIZE=width, BLOCK_SIZE=block, TILE=tile, TILES=tiles,
            TILES_P2=triton.next_power_of_2(tiles), BINS=BINS, num_warps=NUM_WARPS, **flags)

    for i in range(passes):
        launch(COUNT, i, counts[i - 1] if i else counts[0], prefix_k, counts[i], count_block)
        tp.all_reduce(counts[i])   # the counts over ranks
    _top_k_logit_kernel[(RP,)](top_k, counts[-1], counts[0], prefix_k, xk, P, splits, passes - 1, BITS=bits,
                               NC=CANDIDATES, SPLITS_P2=triton.next_power_of_2(splits))
    for i in range(passes):
        last = i == passes - 1   # its digits are single keys: counted, and weighed once a key
        launch(KEY_MASS if last else MASS, i, masses[i - 1] if i else masses[0], prefix_p, masses[i],
               count_block if last else mass_block)
        if i == 0:
            lognorm.copy_(normalise_first_pass(masses[0], ref, tp))
        tp.all_reduce(masses[i])   # the masses over ranks
    out = torch.empty(RP, dtype=torch.float32, device=dev)
    _finish_kernel[(RP,)](temp, top_p, xk, masses[-1], masses[0], prefix_p, out, P, splits, passes - 1, cap, inv_cap,
                          **flags)
    return out.view(R, P)
