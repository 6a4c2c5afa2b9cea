"""The KV cache (a slot's pages) across the three step kinds (docs/spec.md section 1).

A request's life: prefill the prompt; several denoise steps of a canvas whose tokens change between
steps (masks revealed); commit the finished canvas (causal, same positions); then more canvases.
At every denoise and commit step, the logits from the incrementally maintained cache must equal a
full recompute from a fresh cache: the prompt and every committed canvas prefilled as one causal row,
then the current canvas as a denoise row (for a denoise step) or the whole sequence as one causal row
(for a commit).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from model.loader import load_model
from model.attention import gather_keys
from tests.tp_harness import MASK, new_cache, run_rows

TOL = 1e-5
C = 32  # block_size of the tiny checkpoint
VOCAB = 997


@dataclass
class Event:
    kind: str            # "prefill" | "denoise" | "commit"
    start: int           # absolute position of the first token
    tokens: list[int]
    prefix: list[int]    # everything committed before `start` (prompt + earlier canvases)


def schedule(gen: torch.Generator, prompt_len: int, steps_per_canvas: list[int]) -> list[Event]:
    """Prefill, then for each canvas: denoise steps revealing masks (the revealed tokens change the
    canvas between steps; canvas position 0 is seeded), then its commit."""
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
    events = [Event("prefill", 0, prompt, [])]
    committed = list(prompt)
    for steps in steps_per_canvas:
        final = torch.randint(0, VOCAB, (C,), generator=gen)
        final[final == MASK] = MASK + 1  # a commit never holds a mask
        canvas = torch.full((C,), MASK)
        canvas[0] = final[0]
        order = torch.randperm(C - 1, generator=gen) + 1  # reveal order of positions 1..C-1
        per_step = -(-(C - 1) // steps)
        for n in range(steps):
            events.append(Event("denoise", len(committed), canvas.tolist(), list(committed)))
            reveal = order[n * per_step: (n + 1) * per_step]
            canvas = canvas.clone()
            canvas[reveal] = final[reveal]
        assert not (canvas == MASK).any()
        events.append(Event("commit", len(committed), final.tolist(), list(committed)))
        committed += final.tolist()
    return events


def fresh_recompute(model, e: Event) -> torch.Tensor:
    """Logits of event e's tokens from a fresh cache and no history but its committed prefix."""
    kv = new_cache(model, slots=1, max_len=256)
    if e.kind == "denoise":
        run_rows(model, kv, [(0, 0, True)], [e.prefix])
        return run_rows(model, kv, [(0, e.start, False)], [e.tokens])[0, : len(e.tokens)]
    return run_rows(model, kv, [(0, 0, True)], [e.prefix + e.tokens])[0, e.start:]


@pytest.fixture(scope="module")
def model(tiny_nemotron):
    return load_model(tiny_nemotron, show_progress=False)


def _check(model, e: Event, got: torch.Tensor, what: str) -> None:
    expected = fresh_recompute(model, e)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < TOL, f"{what}: {e.kind} at [{e.start}, {e.start + len(e.tokens)}): max |diff| {diff:.3g}"


def cached(kv, which: str, slot: int, n: int) -> torch.Tensor:
    """[layers, n, kv_heads, head_dim]: every layer's keys (which="k") or values of a slot's first n positions,
    read through its page table."""
    pages = kv.page_table[0][slot: slot + 1]
    return torch.stack([gather_keys(t, pages, kv.page_size, n)[0] for t in getattr(kv, which)])


def test_denoise_and_commit_equal_full_recompute(model):
    gen = torch.Generator().manual_seed(11)
    events = schedule(gen, prompt_len=45, steps_per_canvas=[4, 3, 2])
    slot = 2  # not slot 0: slot offsets into the cache matter
    kv = new_cache(model, slots=3, max_len=256)
    denoise_logits = []
    for i, e in enumerate(events):
        committed_k = cached(kv, "k", slot, e.start)
        got = run_rows(model, kv, [(slot, e.start, e.kind != "denoise")], [e.tokens])[0]
        _check(model, e, got, f"event {i}")
        # no step rewrites the committed prefix (a denoise writes only scratch past it)
        assert torch.equal(cached(kv, "k", slot, e.start), committed_k), f"event {i} ({e.kind}) changed the prefix"
        if e.kind == "denoise":
            denoise_logits.append(got)
    # the canvas changes between steps, so successive denoise steps really see different inputs
    assert (denoise_logits[0] - denoise_logits[1]).abs().max() > 1e-2


def test_commit_overwrites_denoise_scratch(model):
    """A denoise step of a canvas leaves scratch KV at the canvas positions; the commit must replace it
    by the causal KV of the final canvas (checked directly on the cache, not only through logits)."""
    gen = torch.Generator().manual_seed(12)
    prefill, denoise, *_ = events = schedule(gen, prompt_len=20, steps_per_canvas=[1])
    commit = events[2]
    kv = new_cache(model, slots=2, max_len=128)
    for e in (prefill, denoise, commit):
        run_rows(model, kv, [(1, e.start, e.kind != "denoise")], [e.tokens])
    ref = new_cache(model, slots=1, max_len=128)
    run_rows(model, ref, [(0, 0, True)], [commit.prefix + commit.tokens])
    n = len(commit.prefix) + C
    for which in ("k", "v"):
        assert (cached(kv, which, 1, n) - cached(ref, which, 0, n)).abs().max() < TOL
    assert cached(kv, "k", 0, 128).abs().max() == 0, "another slot's pages were written"


def test_interleaved_slots_do_not_interfere(model):
    """Requests with different prompt lengths and numbers of denoise steps share batched forwards, so
    prefill, denoise and commit rows of different slots are mixed and padded to one width; each slot's
    logits still equal its own full recompute. The cache is only as long as the longest request, and a
    late long prompt pads the other rows past `max_len`: padding must not wrap into a neighbouring slot
    (slot a's overflow would land on slot b's committed prompt)."""
    gen = torch.Generator().manual_seed(13)
    a = schedule(gen, prompt_len=40, steps_per_canvas=[3, 2, 2])   # ends at 136
    b = schedule(gen, prompt_len=58, steps_per_canvas=[2, 3, 1])   # ends at 154 = max_len
    c = schedule(gen, prompt_len=90, steps_per_canvas=[1])         # ends at 122
    slots = {"a": 0, "b": 1, "c": 3}
    max_len = max(e.start + len(e.tokens) for e in a + b + c)
    kv = new_cache(model, slots=4, max_len=max_len)
    # b starts two forwards after a; c's 90-token prefill lands on a's last canvas (start 104)
    timeline = {"a": a, "b": [None, None] + b, "c": [None] * 8 + c}
    assert timeline["c"][8].kind == "prefill" and timeline["a"][8].start + 90 > max_len
    n_forwards = max(len(t) for t in timeline.values())
    kinds_mixed = 0
    for f in range(n_forwards):
        batch = [(name, t[f]) for name, t in timeline.items() if f < len(t) and t[f] is not None]
        rows = [(slots[name], e.start, e.kind != "denoise") for name, e in batch]
        logits = run_rows(model, kv, rows, [e.tokens for _, e in batch])
        kinds_mixed += len({e.kind for _, e in batch}) > 1
        for row, (name, e) in enumerate(batch):
            _check(model, e, logits[row, : len(e.tokens)], f"forward {f} slot {name}")
    assert kinds_mixed >= 6
