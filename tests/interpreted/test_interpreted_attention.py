"""model.kernels.attention under triton's CPU interpreter against cached_attention's SDPA path
(tests/interpreted/attention_cases.py: the cases and their tolerances), the split combine's row tile,
batch invariance, and cached_attention's switch to the kernel. Run under TRITON_INTERPRET=1 only
(tests/test_interpreted_kernels.py)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

import model.kernels.attention as ka
from tests.interpreted.attention_cases import check, run

# hand-picked steps: every row kind at once, padding queries under a window, shuffled pages of 4 and 3
# positions (a window's pages behind it given back), splits past the key range, GQA 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_steps_equal_sdpa(dtype):
    mixed = [(0, 10, 8, True), (2, 20, 8, False), (3, 5, 3, True), (1, 30, 5, False)]
    for kw in [dict(), dict(window=5), dict(window=1), dict(window=5, page_size=4, shuffled=True),
               dict(window=5, page_size=3, shuffled=True), dict(page_size=4, shuffled=True)]:
        for splits, tiles in [(None, None), (3, (16, 16, 4)), (8, (16, 16, 4))]:
            check(64, 2, 2, dtype, mixed, 8, splits=splits, tiles=tiles, **kw)
    early = [(0, 2, 8, False), (1, 1, 6, True), (3, 7, 8, True)]   # nothing behind the window yet
    check(64, 1, 4, dtype, early, 8, window=6, page_size=4, shuffled=True, splits=2, tiles=(16, 16, 4))


@pytest.mark.parametrize("kw", [dict(), dict(window=3), dict(window=3, page_size=4, shuffled=True)],
                         ids=["full", "window", "shuffled pages"])
def test_fixed_prefills_equal_sdpa(kw):
    prefill = [(0, 0, 8, True), (2, 0, 3, True), (1, 0, 6, False)]
    check(128, 2, 4, torch.float32, prefill, 8, splits=2, tiles=(16, 16, 4), **kw)
    check(128, 2, 4, torch.bfloat16, prefill, 8, **kw)


def test_split_combine_tiles_give_the_same_bits(monkeypatch):
    """The split combine's row tile (COMBINE_VALUES / head dim) is its own, not the attention program's:
    a row's combined result must not depend on it, at the served tile (64 rows here) and at 8 and 256."""
    gen = torch.Generator().manual_seed(5)
    # 150 keys, not 300 (the interpreter's time goes by key blocks): each row's keys are still cut into 3
    # splits of 2-3 blocks of 16 (the third empty for row 1's first queries, causal)
    B, L, hkv, G, D, P = 2, 24, 2, 4, 64, 150
    q = torch.randn(B, L, hkv * G, D, generator=gen).bfloat16()
    k, v = (torch.randn(B, P, hkv, D, generator=gen).bfloat16() for _ in range(2))
    meta = [torch.tensor(x) for x in ([1, 0], [110, 50], [L, 17], [0, 1])]
    # the attention program's partial states do not depend on the combine's tile (the interpreter's time
    # goes to them): the served call's, kept as it hands them to the combine, combined again at the others
    combine, handed = ka.split_combine, []
    monkeypatch.setattr(ka, "split_combine", lambda part, ml, out: (handed.append((part, ml, out)),
                                                                    combine(part, ml, out)))
    outs = [ka.attention(q, k, v, *meta, D ** -0.5, keys=P, splits=3, tiles=(16, 16, 4))]
    (part, ml, out), = handed
    for values in (8 * D, 256 * D):
        monkeypatch.setattr(ka, "COMBINE_VALUES", values)
        outs.append(torch.empty_like(out))
        combine(part, ml, outs[-1])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    one = ka.attention(q, k, v, *meta, D ** -0.5, keys=P, splits=1, tiles=(16, 16, 4))
    assert (one.float() - outs[0].float()).abs().max() <= 2 ** -7 * v.abs().max()


@pytest.mark.parametrize("D,seed,n", [(64, 1, 25), (128, 2, 20), (256, 3, 15)])
def test_random_steps_equal_sdpa(D, seed, n):
    run(D, seed, n)


def step(kv, window, invariant, rows, qs, L):
    """The kernel over a step of `rows` (slot, start, length, causal) whose queries are `qs`, L wide."""
    meta = [torch.tensor(x, dtype=torch.int64) for x in zip(*rows)]
    keys = max(r[1] + L for r in rows)
    qb = torch.zeros(len(rows), L, 4, 64, dtype=kv.k[0].dtype)
    for b, x in enumerate(qs):
        qb[b, : x.shape[1]] = x[0]
    return ka.attention(qb, kv.k[0], kv.v[0], *meta, 0.125, window, keys=keys, page_table=kv.page_table[0],
                        page_size=kv.page_size, invariant=invariant)


def rows_that_differ(invariant, dtypes, monkeypatch):
    """Batch invariance: a row alone (its own width and key bound) and among neighbours (a wider step,
    more keys, other slots) through the kernel; (rows whose real queries' bits differ, rows)."""
    from model.attention import PagedKVCache

    # a GPU of 8 SMs: the default config splits a lone row's keys, not a batch's
    monkeypatch.setattr(ka, "sm_count", lambda device: 8)
    rng = random.Random(7)
    mismatches = cases = 0
    for dtype in dtypes:
        for window, shuffled in [(None, False), (100, False), (150, True)]:
            kv = PagedKVCache.per_slot([(2, 64)], 6, 320, dtype, "cpu", sliding=[window is not None], window=window)
            gen = torch.Generator().manual_seed(len(str(window)) + shuffled)
            for t in (kv.k[0], kv.v[0]):
                t.copy_(torch.randn(t.shape, generator=gen))
            if shuffled:
                n = kv.num_slots * kv.max_pages
                kv.write_pages(0, torch.arange(n), torch.randperm(n, generator=gen))
            for _ in range(4):   # 4 random steps (not 6): the default config's rows differ in 4 of its 12
                width = rng.choice([4, 8])
                slot, causal = rng.randrange(6), rng.random() < 0.5
                start = rng.randint(64, 320 - 12)
                length = rng.randint(1, width) if causal else width
                q = (torch.randn(1, width, 4, 64, generator=gen) * 2).to(dtype)
                alone = step(kv, window, invariant, [(slot, start, length, int(causal))], [q], width)
                others = rng.sample([s for s in range(6) if s != slot], rng.randint(1, 5))
                rows = [(s, rng.randint(0, 320 - 12), 12, 0) for s in others]
                where = rng.randrange(len(rows) + 1)
                rows.insert(where, (slot, start, length, int(causal)))
                qs = [(torch.randn(1, 12, 4, 64, generator=gen) * 2).to(dtype) for _ in others]
                qs.insert(where, q)
                batch = step(kv, window, invariant, rows, qs, 12)
                cases += 1
                mismatches += not torch.equal(alone[0, :length], batch[where, :length])
    return mismatches, cases


def test_invariant_rows_keep_their_bits_among_neighbours(monkeypatch):
    """With invariant=True no row differs."""
    assert rows_that_differ(True, (torch.float32, torch.bfloat16), monkeypatch) == (0, 24)


def test_the_default_configs_rows_differ_among_neighbours(monkeypatch):
    """The same check over the default config (whose splits follow the batch) finds rows that differ, in
    fp32 already, so the check above can tell."""
    mismatches, cases = rows_that_differ(False, (torch.float32,), monkeypatch)
    assert cases == 12 and mismatches > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])   # fp64: the kernel's dtypes
@pytest.mark.parametrize("shuffled", [False, True])                                 # exclude it, SDPA runs
def test_cached_attention_switch_equals_sdpa(shuffled, dtype):
    """cached_attention itself with the switch on, against it with the switch off: the prefill's own keys,
    the full layer's and the sliding layer's pages (in order, or shuffled with the sliding pages behind
    the window given back), in a sequence of steps (and in fp64, which the kernel does not take, the
    switch changes nothing)."""
    from model.attention import (
        PagedKVCache,
        StepContext,
        cached_attention,
        step_context,
        triton_attention,
    )

    gen = torch.Generator().manual_seed(0)
    W = 5
    kv = PagedKVCache.per_slot([(2, 64), (1, 128)], 3, 40, dtype, "cpu", sliding=[False, True], window=W,
                               page_size=4)
    steps = [([0, 2], [0, 0], [8, 5], [True, True], 8),      # prefill
             ([0, 2], [8, 5], [4, 4], [False, False], 4),    # denoise canvases
             ([0, 2, 1], [8, 5, 0], [4, 4, 3], [True, False, True], 4)]   # a commit, a denoise, a prefill
    n = kv.num_slots * kv.max_pages
    order = torch.randperm(n, generator=gen) if shuffled else torch.arange(n)
    for group in (0, 1):
        kv.write_pages(group, torch.arange(n), order)
    for slots, starts, lengths, causal, width in steps:
        if shuffled:   # the sliding pages behind each row's window given back
            for slot, start in zip(slots, starts):
                behind = (max(start - W + 1, 0) // kv.page_size)
                flat = slot * kv.max_pages + torch.arange(behind)
                kv.write_pages(1, flat, torch.full((behind,), -1))
        ctx = StepContext.build(kv, slots, starts, lengths, causal, width, "cpu", window=W)
        B = len(ctx.slots)
        for layer, (hkv, D) in enumerate([(2, 64), (1, 128)]):
            q = torch.randn(B, width, 4, D, generator=gen).to(dtype)
            k, v = (torch.randn(B, width, hkv, D, generator=gen).to(dtype) for _ in range(2))
            with step_context(ctx):
                expected = cached_attention(q, k, v, layer, D ** -0.5, sliding=layer == 1)
                with triton_attention():
                    got = cached_attention(q, k, v, layer, D ** -0.5, sliding=layer == 1)
            tol = (2 ** -16 if dtype == torch.float32 else 2 ** -7) * max(kv.v[layer].abs().max().item(), 1.0)
            assert (got.float() - expected.float()).abs().max().item() <= tol, (layer, shuffled, dtype)
