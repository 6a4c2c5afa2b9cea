"""model.kernels.attention under triton's CPU interpreter against cached_attention's SDPA path.

Each case builds a cache of random contents and a step of random rows (slots, starts, lengths, causal
flags, a window, a ring), runs cached_attention (which writes the step's keys, then gathers and masks
for SDPA), and the kernel on the cache it left (a prefill: on the step's own keys). Tolerances, from
fp32 accumulation in both: fp32 inputs differ only in summation order, 2^-16 max|v| (2^8 ulps of
room; a wrong mask moves outputs by O(max|v|)); bf16 inputs: SDPA rounds the probabilities to bf16
before p @ v and both round the output, each a relative 2^-9 of a convex combination of v, so
2^-7 max|v|.
"""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_marked

CHECK = r"""
import random, time
import torch
from model.attention import LayeredKVCache, StepContext, step_context, cached_attention
from model.kernels.attention import attention

def check(D, hkv, G, dtype, rows, width, window=None, ring=None, splits=None, tiles=None, max_len=48, nslots=4,
          seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots, starts, lengths, causal = (list(c) for c in zip(*rows))
    sliding = window is not None
    kv = LayeredKVCache([(hkv, D)], nslots, max_len, dtype, "cpu", sliding=[sliding], ring=ring)
    for t in (kv.k[0], kv.v[0]):
        t.copy_(torch.randn(t.shape, generator=gen))
    ctx = StepContext.build(kv, slots, starts, lengths, causal, width, "cpu", window=window)
    B = len(rows)
    q = (torch.randn(B, width, hkv * G, D, generator=gen) * 2).to(dtype)
    k, v = (torch.randn(B, width, hkv, D, generator=gen).to(dtype) for _ in range(2))
    scale = D ** -0.5
    with step_context(ctx):
        expected = cached_attention(q, k, v, 0, scale, sliding)
    meta = [torch.tensor(x, dtype=torch.int64) for x in (slots, starts, lengths, [int(c) for c in causal])]
    if ctx.fresh:
        got = attention(q, k, v, torch.arange(B), *meta[1:], scale, window, keys=width, splits=splits, tiles=tiles)
    else:
        R = kv.ring_len if kv.rings[0] else None
        got = attention(q, kv.k[0], kv.v[0], *meta, scale, window, ring=R, keys=ctx.kv_len, splits=splits,
                        tiles=tiles)
    vmax = max(kv.v[0].abs().max().item(), v.abs().max().item())
    tol = (2 ** -16 if dtype == torch.float32 else 2 ** -7) * vmax
    assert got.shape == expected.shape and got.dtype == expected.dtype
    diff = (got.float() - expected.float()).abs().max().item()
    what = dict(D=D, hkv=hkv, G=G, dtype=dtype, rows=rows, width=width, window=window, ring=ring, splits=splits,
                tiles=tiles)
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"
    return diff

def random_case(rng, D, dtype, fresh, window, ring_extra, max_len=48, nslots=4):
    width = rng.choice([4, 8])
    B = rng.randint(1, nslots)
    slots = rng.sample(range(nslots), B)
    rows = []
    for slot in slots:
        causal = rng.random() < 0.5
        start = 0 if fresh else rng.randint(0, max_len - width)
        length = rng.randint(1, width) if causal or rng.random() < 0.3 else width
        rows.append((slot, start, length, causal))
    if not fresh and all(r[1] == 0 for r in rows):
        rows[0] = (rows[0][0], 1, rows[0][2], rows[0][3])
    ring = None if ring_extra is None or window is None else window - 1 + width + ring_extra
    hkv, G = rng.choice([(1, 1), (2, 2), (1, 4), (2, 3)])
    splits = rng.choice([None, 1, 2, 3])
    tiles = rng.choice([None, (16, 16, 4)])
    return dict(D=D, hkv=hkv, G=G, dtype=dtype, rows=rows, width=width, window=window, ring=ring, splits=splits,
                tiles=tiles, max_len=max_len, nslots=nslots)

def run(D, seed, n):
    rng = random.Random(seed)
    t, worst = time.time(), {}
    for c in range(n):
        dtype = (torch.float32, torch.bfloat16)[c % 2]
        fresh = c % 5 == 4
        window = None if c % 3 == 0 else rng.randint(1, 9)
        ring_extra = None if c % 4 < 2 else rng.randint(0, 3)
        case = random_case(rng, D, dtype, fresh, window, ring_extra)
        diff = check(**case, seed=seed * 1000 + c)
        worst[dtype] = max(worst.get(dtype, 0.0), diff)
    print(f"{n} cases D={D} in {time.time() - t:.1f} s, worst {worst}")
"""

# hand-picked steps: every row kind at once, padding queries under a window, a ring that does not yet
# hold position 0's successor, splits past the key range, GQA 4
FIXED = CHECK + r"""
mixed = [(0, 10, 8, True), (2, 20, 8, False), (3, 5, 3, True), (1, 30, 5, False)]
for dtype in (torch.float32, torch.bfloat16):
    for kw in [dict(), dict(window=5), dict(window=1), dict(window=5, ring=4 + 8), dict(window=5, ring=4 + 8 + 3)]:
        for splits, tiles in [(None, None), (3, (16, 16, 4)), (8, (16, 16, 4))]:
            check(64, 2, 2, dtype, mixed, 8, splits=splits, tiles=tiles, **kw)
    early = [(0, 2, 8, False), (1, 1, 6, True), (3, 7, 8, True)]   # rings not yet full
    check(64, 1, 4, dtype, early, 8, window=6, ring=5 + 8, splits=2, tiles=(16, 16, 4))
prefill = [(0, 0, 8, True), (2, 0, 3, True), (1, 0, 6, False)]
for kw in [dict(), dict(window=3), dict(window=3, ring=2 + 4)]:   # the ring shorter than the prefill
    check(128, 2, 4, torch.float32, prefill, 8, splits=2, tiles=(16, 16, 4), **kw)
    check(128, 2, 4, torch.bfloat16, prefill, 8, **kw)
print("fixed cases pass")
"""


@pytest.mark.interpreted(FIXED, "fixed cases pass", timeout=120)
def test_fixed_steps_equal_sdpa(request):
    run_marked(request)


# the split combine's row tile (COMBINE_VALUES / head dim) is its own, not the attention program's: a
# row's combined result must not depend on it, at the served tile (64 rows here) and at 8 and 256
COMBINE_TILES = r"""
import torch
import model.kernels.attention as ka
gen = torch.Generator().manual_seed(5)
B, L, hkv, G, D, P = 2, 24, 2, 4, 64, 300
q = torch.randn(B, L, hkv * G, D, generator=gen).bfloat16()
k, v = (torch.randn(B, P, hkv, D, generator=gen).bfloat16() for _ in range(2))
meta = [torch.tensor(x) for x in ([1, 0], [260, 100], [L, 17], [0, 1])]
outs = []
for values in (ka.COMBINE_VALUES, 8 * D, 256 * D):
    ka.COMBINE_VALUES = values
    outs.append(ka.attention(q, k, v, *meta, D ** -0.5, keys=P, splits=3, tiles=(16, 16, 4)))
assert all(torch.equal(outs[0], o) for o in outs[1:])
one = ka.attention(q, k, v, *meta, D ** -0.5, keys=P, splits=1, tiles=(16, 16, 4))
assert (one.float() - outs[0].float()).abs().max() <= 2 ** -7 * v.abs().max()
print("combine tiles agree")
"""


@pytest.mark.interpreted(COMBINE_TILES, "combine tiles agree", timeout=120)
def test_split_combine_tiles_give_the_same_bits(request):
    run_marked(request)


@pytest.mark.parametrize("D,seed,n", [pytest.param(D, seed, n, marks=pytest.mark.interpreted(
    CHECK + f"run({D}, {seed}, {n})\nprint('random cases pass')", "random cases pass", timeout=120))
    for D, seed, n in [(64, 1, 25), (128, 2, 20), (256, 3, 15)]])
def test_random_steps_equal_sdpa(D, seed, n, request):
    run_marked(request)


# batch invariance: a row alone (its own width and key bound) and among neighbours (a wider step, more
# keys, other slots), with invariant=True, gives the same bits for its real queries
INVARIANT = r"""
import random
import torch
import model.kernels.attention as ka
from model.attention import LayeredKVCache
from model.kernels.attention import attention

invariant = INVARIANT_FLAG
ka.sm_count = lambda device: 8   # a GPU of 8 SMs: the default config splits a lone row's keys, not a batch's
rng = random.Random(7)
mismatches = cases = 0
for dtype in INVARIANT_DTYPES:
    for window, ring in [(None, None), (100, None), (150, 150 - 1 + 12)]:
        kv = LayeredKVCache([(2, 64)], 6, 320, dtype, "cpu", sliding=[window is not None], ring=ring)
        gen = torch.Generator().manual_seed(len(str(window)) + (ring or 0))
        for t in (kv.k[0], kv.v[0]):
            t.copy_(torch.randn(t.shape, generator=gen))
        for _ in range(6):
            width = rng.choice([4, 8])
            slot, causal = rng.randrange(6), rng.random() < 0.5
            start = rng.randint(64, 320 - 12)
            length = rng.randint(1, width) if causal else width
            q = (torch.randn(1, width, 4, 64, generator=gen) * 2).to(dtype)
            def run(rows, qs, L):
                meta = [torch.tensor(x, dtype=torch.int64) for x in zip(*rows)]
                keys = max(r[1] + L for r in rows)
                qb = torch.zeros(len(rows), L, 4, 64, dtype=dtype)
                for b, x in enumerate(qs):
                    qb[b, : x.shape[1]] = x[0]
                R = kv.ring_len if ring else None
                return attention(qb, kv.k[0], kv.v[0], *meta, 0.125, window, ring=R, keys=keys if not ring else None,
                                 invariant=invariant)
            alone = run([(slot, start, length, int(causal))], [q], width)
            others = rng.sample([s for s in range(6) if s != slot], rng.randint(1, 5))
            rows = [(s, rng.randint(0, 320 - 12), 12, 0) for s in others]
            where = rng.randrange(len(rows) + 1)
            rows.insert(where, (slot, start, length, int(causal)))
            qs = [(torch.randn(1, 12, 4, 64, generator=gen) * 2).to(dtype) for _ in others]
            qs.insert(where, q)
            batch = run(rows, qs, 12)
            cases += 1
            mismatches += not torch.equal(alone[0, :length], batch[where, :length])
print(f"{mismatches} of {cases} rows differ")
"""


@pytest.mark.interpreted(INVARIANT.replace("INVARIANT_FLAG", "True").replace(
    "INVARIANT_DTYPES", "(torch.float32, torch.bfloat16)"), "0 of 36 rows differ", timeout=150)
def test_invariant_rows_keep_their_bits_among_neighbours(request):
    """With invariant=True no row differs."""
    run_marked(request)


@pytest.mark.interpreted(INVARIANT.replace("INVARIANT_FLAG", "False").replace("INVARIANT_DTYPES", "(torch.float32,)"),
                         "rows differ", timeout=150)
def test_the_default_configs_rows_differ_among_neighbours(request):
    """The same check over the default config (whose splits follow the batch) finds rows that differ, in
    fp32 already, so the check above can tell."""
    out = run_marked(request)
    assert "0 of 18 rows differ" not in out, out


# cached_attention itself with the switch on, against it with the switch off: the prefill's own keys,
# the full layer's flat cache, the sliding layer's flat cache or ring, in a sequence of steps (and in
# fp64, which the kernel does not take, the switch changes nothing)
SWITCH = r"""
import torch
from model.attention import LayeredKVCache, StepContext, step_context, cached_attention, triton_attention

def layers(kv, ctx, gen, dtype, width):
    B = len(ctx.slots)
    for layer, (hkv, D) in enumerate([(2, 64), (1, 128)]):
        q = torch.randn(B, width, 4, D, generator=gen).to(dtype)
        k, v = (torch.randn(B, width, hkv, D, generator=gen).to(dtype) for _ in range(2))
        with step_context(ctx):
            expected = cached_attention(q, k, v, layer, D ** -0.5, sliding=layer == 1)
            with triton_attention():
                got = cached_attention(q, k, v, layer, D ** -0.5, sliding=layer == 1)
        tol = (2 ** -16 if dtype == torch.float32 else 2 ** -7) * max(kv.v[layer].abs().max().item(), 1.0)
        assert (got.float() - expected.float()).abs().max().item() <= tol, (layer, ctx.ring is not None, dtype)

for ring in (None, 12):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):   # fp64: the kernel's dtypes exclude it, SDPA runs
        gen = torch.Generator().manual_seed(0)
        kv = LayeredKVCache([(2, 64), (1, 128)], 3, 40, dtype, "cpu", sliding=[False, True], ring=ring)
        W = 5
        steps = [([0, 2], [0, 0], [8, 5], [True, True], 8),      # prefill
                 ([0, 2], [8, 5], [4, 4], [False, False], 4),    # denoise canvases
                 ([0, 2, 1], [8, 5, 0], [4, 4, 3], [True, False, True], 4)]   # a commit, a denoise, a prefill
        for slots, starts, lengths, causal, width in steps:
            ctx = StepContext.build(kv, slots, starts, lengths, causal, width, "cpu", window=W)
            layers(kv, ctx, gen, dtype, width)
print("switch equals sdpa")
"""


@pytest.mark.interpreted(SWITCH, "switch equals sdpa", timeout=120)
def test_cached_attention_switch_equals_sdpa(request):
    run_marked(request)


def _gpu_step(kv, B, width, starts_from, window, gen):
    import random

    rng = random.Random(gen.initial_seed())
    slots = rng.sample(range(kv.num_slots), B)
    causal = [rng.random() < 0.5 for _ in range(B)]
    starts = [rng.randint(starts_from, kv.max_len - width) for _ in range(B)]
    lengths = [rng.randint(1, width) if c else width for c in causal]
    from model.attention import StepContext

    return StepContext.build(kv, slots, starts, lengths, causal, width, "cuda", window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D,sliding,ring", [(32, 8, 128, False, None), (16, 8, 256, True, None),
                                                    (16, 8, 256, True, 511 + 32), (16, 2, 512, False, None)])
@pytest.mark.parametrize("B", [1, 16])
@pytest.mark.parametrize("invariant", [False, True])
def test_cuda_kernel_equals_sdpa(hq, hkv, D, sliding, ring, B, invariant):
    """On CUDA in bf16 at serving shapes (B x 32 queries over up to ~1100 keys: batch 1 splits its keys,
    batch 16 does not; batch-invariant mode's fixed tiles), cached_attention's kernel against its SDPA
    path."""
    from model import batch_invariant
    from model.attention import LayeredKVCache, cached_attention, step_context, triton_attention

    gen = torch.Generator().manual_seed(D + hkv + bool(ring) + B)
    W = 512
    kv = LayeredKVCache([(hkv, D)], 16, 1088, torch.bfloat16, "cuda", sliding=[sliding], ring=ring)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    ctx = _gpu_step(kv, B, 32, 0, W, gen)
    q = (torch.randn(B, 32, hq, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    k, v = (torch.randn(B, 32, hkv, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    with step_context(ctx), torch.no_grad(), batch_invariant.batch_invariant(invariant):
        with triton_attention(False):
            expected = cached_attention(q, k, v, 0, D ** -0.5, sliding=sliding)
        with triton_attention(True):
            got = cached_attention(q, k, v, 0, D ** -0.5, sliding=sliding)
    vmax = max(kv.v[0].abs().max().item(), v.abs().max().item())
    assert (got.float() - expected.float()).abs().max().item() <= 2 ** -7 * vmax
