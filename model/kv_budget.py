"""How many KV pages each layer group gets from a device's memory (gpu_memory_utilization, as vLLM's).

The pool takes what is left of `utilization` x the device's memory once the weights, everything else on
the device (other processes included) and the steps' working memory are counted: the peak of the
largest steps run eagerly before the pool exists, reserved twice, since the CUDA graphs' private pool
holds a copy of it and a step outside the graph set runs eagerly beside it. A sliding-window group holds
at most what its requests can hold at once (a window, a prefill chunk and the commands in flight, per
slot), so the full-attention group gets the rest. docs/design.md (Memory) says how it is used.
"""
from __future__ import annotations

import math

from model.protocol import COMMANDS_AHEAD


def sliding_pages(window: int, ahead: int, page_size: int) -> int:
    """The most pages of a sliding group one request holds at once: the pages its window reaches back
    over, those its tables run `ahead` of its known length, and the two partly filled ends."""
    return -(-(window - 1) // page_size) + -(-ahead // page_size) + 2


def canvas_growth(steps: int, canvas: int) -> int:
    """How far past its known length `steps` steps of a canvas request write: at most one commit every
    other step, and a canvas of scratch past it."""
    return -(-steps // 2) * canvas + canvas


def ahead_positions(max_model_len: int, prefill_chunk: int, max_steps_per_command: int, canvas: int) -> int:
    """The furthest a request's page tables run past its known length: a prompt chunk, then what the
    commands in flight and the next can write (a canvas request's: more than an AR one's)."""
    return min(max_model_len, prefill_chunk) + canvas_growth(COMMANDS_AHEAD * max_steps_per_command, canvas)


def pool_pages(budget_bytes: int, page_bytes: list[int], windows: list[int | None], sliding_cap: int
               ) -> list[int]:
    """Pages per group (groups as model.interface.KVLayout orders them) within `budget_bytes`, each group
    paying page_bytes[g] a page (its sink page included): every full group the same count P, every
    sliding group min(P, sliding_cap)."""
    full = sum(b for b, w in zip(page_bytes, windows) if w is None)
    sliding = sum(b for b, w in zip(page_bytes, windows) if w is not None)
    pages = budget_bytes // (full + sliding) - 1          # P <= sliding_cap: every group P (and its sink)
    if sliding and pages > sliding_cap and full:          # the sliding groups stop at their cap
        pages = (budget_bytes - (sliding_cap + 1) * sliding) // full - 1
    pages = max(pages, 0)
    return [pages if w is None else min(pages, sliding_cap) for w in windows]


def memory_budget(total: int, free: int, utilization: float, steps_peak: int) -> int:
    """Bytes the pool may take: `utilization` of the device less what is in use now (this process's
    weights and buffers, and any other process's) and twice the steps' peak working memory."""
    return math.floor(utilization * total) - (total - free) - 2 * steps_peak
