"""Cases of model.kernels.attention against cached_attention's SDPA path (tests/interpreted/
test_interpreted_attention.py): `check` runs one step both ways, `random_case` draws one.

A case builds a paged cache of random contents (its pages in order, or shuffled with a sliding layer's
pages behind the window given back to the sink) and a step of random rows (slots, starts, lengths,
causal flags, a window), runs cached_attention (which writes the step's keys, then gathers and masks for
SDPA), and the kernel on the cache it left (a prefill: on the step's own keys). Tolerances, from fp32
accumulation in both: fp32 inputs differ only in summation order, 2^-16 max|v| (2^8 ulps of room; a
wrong mask moves outputs by O(max|v|)); bf16 inputs: SDPA rounds the probabilities to bf16 before p @ v
and both round the output, each a relative 2^-9 of a convex combination of v, so 2^-7 max|v|.
"""
from __future__ import annotations

import random
import time

import torch

from model.attention import PagedKVCache, StepContext, cached_attention, step_context
from model.kernels.attention import attention


def shuffle_pages(kv: PagedKVCache, rows, window, gen) -> None:
    """The cache's pages in a random order, and a sliding layer's pages wholly behind each row's window
    (before start - window + 1) given back: their table entries the sink."""
    n = kv.max_pages * kv.num_slots
    order = torch.randperm(n, generator=gen).view(kv.num_slots, kv.max_pages)
    for slot, start, _, _ in rows:
        if window is not None:
            order[slot, : max(start - window + 1, 0) // kv.page_size] = -1
    flat = torch.arange(n)
    kv.write_pages(0, flat, order.flatten())


def check(D, hkv, G, dtype, rows, width, window=None, page_size=16, shuffled=False, splits=None, tiles=None,
          max_len=48, nslots=4, seed=0):
    """The kernel against SDPA on one step; the max |difference|."""
    gen = torch.Generator().manual_seed(seed)
    slots, starts, lengths, causal = (list(c) for c in zip(*rows))
    sliding = window is not None
    kv = PagedKVCache.per_slot([(hkv, D)], nslots, max_len, dtype, "cpu", sliding=[sliding], window=window,
                               page_size=page_size)
    for t in (kv.k[0], kv.v[0]):
        t.copy_(torch.randn(t.shape, generator=gen))
    if shuffled:
        shuffle_pages(kv, rows, window, gen)
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
        got = attention(q, kv.k[0], kv.v[0], *meta, scale, window, keys=ctx.kv_len, page_table=kv.page_table[0],
                        page_size=kv.page_size, splits=splits, tiles=tiles)
    vmax = max(kv.v[0].abs().max().item(), v.abs().max().item())
    tol = (2 ** -16 if dtype == torch.float32 else 2 ** -7) * vmax
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.isfinite(got).all()   # padding queries too: the layers after attention read them
    # real queries only: a padding query's output is never read, and on a sliding layer the kernel gives it
    # its block's keys where SDPA gives it the full row
    real = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, :, None, None]
    diff = ((got.float() - expected.float()).abs() * real).max().item()
    what = dict(D=D, hkv=hkv, G=G, dtype=dtype, rows=rows, width=width, window=window, page_size=page_size,
                shuffled=shuffled, splits=splits, tiles=tiles)
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"
    return diff


def random_case(rng, D, dtype, fresh, window, paging, max_len=48, nslots=4):
    """`check`'s arguments for a random step of head dim D."""
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
    page_size, shuffled = paging
    hkv, G = rng.choice([(1, 1), (2, 2), (1, 4), (2, 3)])
    splits = rng.choice([None, 1, 2, 3])
    tiles = rng.choice([None, (16, 16, 4)])
    return dict(D=D, hkv=hkv, G=G, dtype=dtype, rows=rows, width=width, window=window, page_size=page_size,
                shuffled=shuffled, splits=splits, tiles=tiles, max_len=max_len, nslots=nslots)


def run(D, seed, n):
    """n random steps of head dim D, alternating fp32 and bf16, every 5th a prefill, 2 in 3 under a
    window, half on shuffled pages of 4 or 3 positions; the worst difference per dtype."""
    rng = random.Random(seed)
    t, worst = time.time(), {}
    for c in range(n):
        dtype = (torch.float32, torch.bfloat16)[c % 2]
        fresh = c % 5 == 4
        window = None if c % 3 == 0 else rng.randint(1, 9)
        paging = (16, False) if c % 4 < 2 else (rng.choice([3, 4]), True)
        case = random_case(rng, D, dtype, fresh, window, paging)
        diff = check(**case, seed=seed * 1000 + c)
        worst[dtype] = max(worst.get(dtype, 0.0), diff)
    print(f"{n} cases D={D} in {time.time() - t:.1f} s, worst {worst}")
    return worst
