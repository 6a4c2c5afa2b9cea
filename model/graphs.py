"""CUDA graphs for canvas-wide forwards (denoise, commit, draft, verify rows: tokens [B, C]).

A forward of the 8B model is a few hundred small kernels; launched one by one from Python their
launch cost exceeds the GPU time of a batch-1 step. A graph replays them in one launch. One graph is
captured lazily per (rows B, keys K), K rounded up to a bucket so a handful of graphs cover a
request's growth. Everything step-specific enters through two static device tensors: the step's
metadata `meta` = [slots; starts; lengths; causal] ([4, B] int64) and the tokens; the attention
context (masks, write rows, positions) is computed from them inside the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.attention import StepContext, sliding_window_mask, step_context

KEY_BUCKET = 256


def device_context(kv, meta: torch.Tensor, width: int, kv_len: int,
                   window: int | None = None) -> tuple[StepContext, torch.Tensor]:
    """The StepContext of rows described by `meta` [4, B] (slots, starts, lengths, causal), computed
    with device ops only (no host values, so it can be captured). Returns it and positions [B, width].
    `window`: the sliding window of sliding-attention layers (DiffusionGemma), None for none."""
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
    ctx = StepContext(kv=kv, slots=slot, write_index=write.flatten(), kv_len=kv_len, mask=visible.unsqueeze(1),
                      window_mask=window_mask, causal_rows=causal)
    return ctx, pos


def keys_for(starts: list[int], width: int, max_len: int, bucket: int = 1) -> int:
    return min(-(-(max(starts) + width) // bucket) * bucket, max_len)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    meta: torch.Tensor      # [4, B] static input
    tokens: torch.Tensor    # [B, W] static input
    hidden: torch.Tensor    # [B, W, H] static output


class CanvasGraphs:
    def __init__(self, model, kv, width: int):
        self.model, self.kv, self.width = model, kv, width
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _run(self, meta: torch.Tensor, tokens: torch.Tensor, kv_len: int) -> torch.Tensor:
        ctx, positions = device_context(self.kv, meta, self.width, kv_len)
        with step_context(ctx):
            return self.model(tokens, positions)

    def _capture(self, rows: int, kv_len: int) -> _Captured:
        dev = self.kv.k[0].device if isinstance(self.kv.k, list) else self.kv.k.device
        # warm-up and capture write their keys into the sink slot: no real slot is touched
        meta = torch.tensor([[self.kv.num_slots] * rows, [0] * rows, [self.width] * rows, [0] * rows],
                            dtype=torch.int64, device=dev)
        tokens = torch.zeros(rows, self.width, dtype=torch.int64, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self._run(meta, tokens, kv_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            hidden = self._run(meta, tokens, kv_len)
        return _Captured(graph, meta, tokens, hidden)

    def forward(self, meta_host: torch.Tensor, tokens: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """meta_host: pinned [4, B] int64; tokens: [B, W] on the device. The returned hidden states
        are the graph's static output: read them before the next replay."""
        rows = meta_host.shape[1]
        kv_len = keys_for(starts, self.width, self.kv.max_len, KEY_BUCKET)
        key = (rows, kv_len)
        if key not in self.captured:
            self.captured[key] = self._capture(rows, kv_len)
        g = self.captured[key]
        g.meta.copy_(meta_host, non_blocking=True)
        g.tokens.copy_(tokens)
        g.graph.replay()
        return g.hidden
