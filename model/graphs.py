"""CUDA graphs of whole steps (forward, sampler, state update of a canvas-wide or AR step) and of prefills
up to PREFILL_GRAPH_TOKENS (past a cached prefix: up to PAST_PREFIX_GRAPH_WIDTH wide), from a closed set
captured before a shard serves.

A graph is keyed by its step kind and graph plan (model/steps/plan.py): the batch padded to the next
capture size, the key bucket its rows read, and whether it scores. Request options are device data, so
no option adds a key and the set's size is a formula of the slots and max_model_len. `Runner.warm_up`
captures them all and `freeze`s; a step outside the set then runs eagerly and is counted. Keys grow two
buckets an octave. The formula and the reasons: docs/design.md, "CUDA graphs".
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

KEY_BUCKET = 256
MIN_PREFILL_WIDTH = 16
# larger prefills run eagerly, unpadded: their launches weigh less next to their kernels, and a graph of
# each width would keep its activations' peak in the graphs' pool
PREFILL_GRAPH_TOKENS = 4096
# prefills past a cached prefix (a conversation's next turn, a long prompt's later chunk) up to this width
# are graphed too, over the cache's whole length of keys (attention divides the keys each row has among
# its splits, on the device), so neither the prefix's length nor the turn's adds a key: eagerly, a turn of
# a few dozen tokens costs its launches, not its kernels
PAST_PREFIX_GRAPH_WIDTH = 256


DENSE_CAPTURE_SIZES = 8   # every batch size up to this one has its own graphs; past it, steps of this many


def capture_sizes(num_slots: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: every size up to DENSE_CAPTURE_SIZES, then its multiples
    below num_slots, and num_slots. A padding row of a canvas step costs a whole row's experts and
    attention, so six rows padded to eight would be priced as eight: at the small batches a diffusion
    server runs, a graph a size costs less than the rows it would pad."""
    dense = list(range(1, min(num_slots, DENSE_CAPTURE_SIZES) + 1))
    steps = list(range(2 * DENSE_CAPTURE_SIZES, num_slots, DENSE_CAPTURE_SIZES))
    return tuple(dict.fromkeys(dense + steps + [num_slots]))


def padded_size(rows: int, sizes: tuple[int, ...]) -> int:
    return sizes[bisect.bisect_left(sizes, rows)]


def _geometric(first: int, limit: int) -> list[int]:
    """first, 1.5 first, 2 first, 3 first, 4 first, ... (two an octave) below limit."""
    out, v = [], first
    while v < limit:
        out += [v] + ([v * 3 // 2] if v * 3 // 2 < limit else [])
        v *= 2
    return out


def key_buckets(max_len: int) -> tuple[int, ...]:
    """The key lengths steps read: KEY_BUCKET, then two an octave, up to max_len."""
    return tuple(_geometric(KEY_BUCKET, max_len) + [max_len])


def bucket(keys: int, max_len: int) -> int:
    """The smallest key bucket holding `keys` (max_len at most)."""
    buckets = key_buckets(max_len)
    return buckets[min(bisect.bisect_left(buckets, keys), len(buckets) - 1)]


def prefill_widths(max_len: int) -> tuple[int, ...]:
    """The widths graphed prefills run at: powers of two from MIN_PREFILL_WIDTH to KEY_BUCKET, then the
    key buckets, up to PREFILL_GRAPH_TOKENS and max_len."""
    limit = min(PREFILL_GRAPH_TOKENS, max_len)
    small = [w for w in _powers(MIN_PREFILL_WIDTH, KEY_BUCKET) if w < limit]
    return tuple(small + [w for w in key_buckets(limit) if w > (small[-1] if small else 0)])


def _powers(first: int, last: int) -> list[int]:
    return [1 << i for i in range(first.bit_length() - 1, last.bit_length()) if first <= 1 << i < last]


def graph_widths(rows: int, max_len: int, fresh: bool = True) -> list[int]:
    """The widths the graph set holds prefills of `rows` rows at: rows x width within PREFILL_GRAPH_TOKENS;
    past a cached prefix (not `fresh`), up to PAST_PREFIX_GRAPH_WIDTH. The warm-up captures these and a
    prefill looks its width up among them (prefill_width): one rule for both."""
    return [w for w in prefill_widths(max_len)
            if rows * w <= PREFILL_GRAPH_TOKENS and (fresh or w <= PAST_PREFIX_GRAPH_WIDTH)]


def prefill_width(longest: int, rows: int, max_len: int, fresh: bool = True) -> int | None:
    """The width a graphed prefill of `rows` prompts up to `longest` tokens (past a cached prefix: new
    tokens, not `fresh`) runs at; None: too wide for a graph (it runs eagerly)."""
    return next((w for w in graph_widths(rows, max_len, fresh) if w >= longest), None)


class StepGraphs:
    """Graphs by key. `capture=False` runs every step eagerly through the same keys (the CPU's stand-in:
    the runner pads and plans exactly as it does on CUDA)."""

    def __init__(self, device: torch.device, capture: bool = True):
        self.device, self.capturing = device, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}   # None: warmed up, not captured yet
        self.inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.frozen = False
        self.eager_steps = 0         # steps run outside a graph since freeze()
        self.captured_at_freeze = 0

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
        pinned = self.device.type == "cuda"
        return self.static_inputs(key, *(torch.tensor(v, dtype=torch.int64, pin_memory=pinned) for v in (idx, scored)))

    def capture(self, key: tuple, step: Callable[..., None], *inputs: torch.Tensor, warm: bool = True) -> None:
        """step(*inputs) captured (not run); with `warm`, run once eagerly first (kernels, allocators and
        communicators warm up): only for steps whose rows are all padding."""
        if warm:
            step(*inputs)
        if not self.capturing:
            self.graphs[key] = None
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step(*inputs)
        self.graphs[key] = graph

    def run(self, key: tuple, step: Callable[..., None], *inputs: torch.Tensor) -> None:
        """step(*inputs): replayed if captured. Before freeze() a key's first run is eager and its second
        captured (runners that were never warmed up: tests, benchmarks); after it, an unknown key runs
        eagerly, and is counted."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self.frozen or not self.capturing:
            if key not in self.graphs:
                if self.frozen:
                    self.eager_steps += 1
                else:
                    self.graphs[key] = None   # the keys a runner without captures ran (tests)
            step(*inputs)
            return
        if key not in self.graphs:
            step(*inputs)
            self.graphs[key] = None
            return
        self.capture(key, step, *inputs, warm=False)
        self.graphs[key].replay()

    def freeze(self) -> None:
        self.frozen = True
        self.captured_at_freeze = self.captured

    @property
    def captured(self) -> int:
        return sum(g is not None for g in self.graphs.values())

    def pool_bytes(self) -> int:
        """Device memory the graphs' private pool holds (0 without captures)."""
        if self.pool is None:
            return 0
        pool = tuple(self.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)
