"""CUDA graphs of whole steps: forward, sampler and state update of a canvas-wide or AR step.

A forward of the 8B model is a few hundred kernels and the sampler a few dozen more; launched one by
one from Python their launch cost exceeds the GPU time of a small batch. A step reads everything from
the runner's slot-indexed buffers through two index tensors (its rows' slots, its scored rows) and
writes its results back into them, so a graph of it needs nothing but those two indices copied in.
Graphs are keyed by the step kind and its RowPlan (batch, key length, sampler work); the first run of
a key is eager (it warms up kernels, allocators and communicators and does the real step), the second
is captured and replayed, every later one replayed.

`device_context` builds a step's attention context from device tensors only, so it is captured too.
"""
from __future__ import annotations

from typing import Callable

import torch

from model.attention import StepContext, ring_view, sliding_window_mask

KEY_BUCKET = 256


def device_context(kv, meta: torch.Tensor, width: int, kv_len: int, window: int | None = None,
                   fresh: bool = False) -> tuple[StepContext, torch.Tensor]:
    """The StepContext of rows described by `meta` [4, B] (slots, starts, lengths, causal), computed
    with device ops only (no host values, so it can be captured). Returns it and positions [B, width].
    `window`: the sliding window of sliding-attention layers (DiffusionGemma), None for none;
    `fresh`: every row starts at 0 (a prefill), so attention reads the step's own keys."""
    slot, start, length, causal = meta[0], meta[1], meta[2], meta[3].bool()
    i = torch.arange(width, device=meta.device)
    pos = start[:, None] + i[None, :]
    real = i[None, :] < length[:, None]
    write = torch.where(real, slot[:, None] * kv.max_len + pos, kv.sink)
    j = torch.arange(kv_len, device=meta.device)[None, None, :]
    first, end = start[:, None, None], (start + length)[:, None, None]
    in_segment = (j >= first) & (j < end)
    visible = (j < first) | (in_segment & (~causal[:, None, None] | (j <= pos[:, :, None])))
    window_mask = None if window is None else sliding_window_mask(visible, pos, start, real, causal, window)
    ring = None
    if getattr(kv, "ring_len", None):
        if not fresh and width > kv.ring_len:
            raise ValueError(f"a step of width {width} after a prefill does not fit the ring of {kv.ring_len}")
        ring = ring_view(kv, slot, start, length, pos, real, causal, width, window, fresh)
    ctx = StepContext(kv=kv, slots=slot, write_index=write.flatten(), kv_len=kv_len, mask=visible.unsqueeze(1),
                      window_mask=window_mask, causal_rows=causal, fresh=fresh, ring=ring, starts=start,
                      lengths=length, window=window)
    return ctx, pos


def bucket(keys: int, max_len: int) -> int:
    return min(-(-keys // KEY_BUCKET) * KEY_BUCKET, max_len)


class StepGraphs:
    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}   # None: warmed up, not captured yet
        self.inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def index_inputs(self, key: tuple, idx: list[int], scored: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The key's static index tensors, holding `idx` and `scored` (copied without a sync)."""
        if key not in self.inputs:
            self.inputs[key] = (torch.zeros(len(idx), dtype=torch.int64, device=self.device),
                                torch.zeros(len(scored), dtype=torch.int64, device=self.device))
        static = self.inputs[key]
        for dst, values in zip(static, (idx, scored)):
            if values:
                dst.copy_(torch.tensor(values, dtype=torch.int64, pin_memory=True), non_blocking=True)
        return static

    def run(self, key: tuple, step: Callable[[torch.Tensor, torch.Tensor], None], idx: torch.Tensor,
            scored: torch.Tensor) -> None:
        if key not in self.graphs:
            step(idx, scored)
            self.graphs[key] = None
            return
        graph = self.graphs[key]
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step(idx, scored)
            self.graphs[key] = graph
        graph.replay()
