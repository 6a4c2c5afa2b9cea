"""CUDA graphs of whole steps: forward, sampler and state update of a canvas-wide or AR step, and of
prefills up to PREFILL_GRAPH_TOKENS (rows x width).

A forward of the 8B model is a few hundred kernels and the sampler a few dozen more; launched one by
one from Python their launch cost exceeds the GPU time of a small batch. A step reads everything from
the runner's slot-indexed buffers through two index tensors (its rows' slots, its scored rows) and
writes its results back into them, so a graph of it needs nothing but those two indices copied in.
Graphs are keyed by the step kind and its RowPlan (batch, key length, sampler work); the first run of
a key is eager (it warms up kernels, allocators and communicators and does the real step), the second
is captured and replayed, every later one replayed.

A prefill of at most PREFILL_GRAPH_TOKENS (rows x width) is a graph too, keyed by its plan and its
width: its prompts padded to `prefill_width` (a power of two up to KEY_BUCKET, then a multiple of it),
its tokens, lengths and modes copied in with its indices. Eager, the 26B-A4B DiffusionGemma shape's
1024-token prefill took 97 ms on an H200 whose kernels took ~30: per layer, some forty kernels and six
compiled chains launched from Python. Padding changes no real row: a padded position writes the KV
cache's sink, and a real query never sees it.

A step's attention context is built from device tensors only (model.attention.device_context), so it is
captured too.
"""
from __future__ import annotations

from typing import Callable

import torch


KEY_BUCKET = 256
# larger prefills run eagerly, unpadded: their launches weigh less next to their kernels, and a graph of
# each width would keep its activations' peak in the graphs' pool (not tuned: measured at 1024 tokens)
PREFILL_GRAPH_TOKENS = 4096


def bucket(keys: int, max_len: int) -> int:
    return min(-(-keys // KEY_BUCKET) * KEY_BUCKET, max_len)


def prefill_width(longest: int, max_len: int) -> int:
    """The width a graphed prefill of prompts up to `longest` tokens runs at (>= longest; few widths)."""
    if longest <= KEY_BUCKET:
        return min(max(16, 1 << (longest - 1).bit_length()), max(max_len, longest))
    return max(bucket(longest, max_len), longest)


class StepGraphs:
    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}   # None: warmed up, not captured yet
        self.inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def static_inputs(self, key: tuple, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The key's static device tensors, holding `host` (pinned host tensors; copied without a sync)."""
        if key not in self.inputs:
            self.inputs[key] = tuple(torch.empty_like(h, device=self.device) for h in host)
        static = self.inputs[key]
        for dst, values in zip(static, host, strict=True):
            if values.numel():
                dst.copy_(values, non_blocking=True)
        return static

    def index_inputs(self, key: tuple, idx: list[int], scored: list[int]) -> tuple[torch.Tensor, ...]:
        """The key's static index tensors, holding `idx` and `scored`."""
        return self.static_inputs(key, *(torch.tensor(v, dtype=torch.int64, pin_memory=True) for v in (idx, scored)))

    def run(self, key: tuple, step: Callable[..., None], *inputs: torch.Tensor) -> None:
        """step(*inputs): eager on the key's first run, captured on its second, replayed from then on."""
        if key not in self.graphs:
            step(*inputs)
            self.graphs[key] = None
            return
        graph = self.graphs[key]
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step(*inputs)
            self.graphs[key] = graph
        graph.replay()
