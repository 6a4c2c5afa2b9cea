"""Attention over a per-slot KV cache for the three step kinds (SPEC.md section 1).

One forward carries B rows, each a segment of one slot padded to a common length L:
  prefill  causal over prompt tokens, keys = the slot's cache before it + itself;
  denoise  bidirectional over the canvas, keys = the committed prefix + the whole canvas;
  commit   causal over the finished canvas at the same positions.
Every row's new keys and values are written at their absolute positions in the slot's cache before
attention reads it. For denoise rows those positions lie past the committed prefix, so the write is
scratch that the canvas's commit overwrites: only `prefix_len` positions of a slot are ever valid.
Padding tokens write into a sink row that nothing reads.

Sliding-window layers (DiffusionGemma, SPEC.md 2.2) read a second mask, `window_mask`: a causal row's
query at position q sees keys (q - W, q]; a denoise row's queries see the last W - 1 prefix keys plus
the whole canvas, the window anchored at the canvas start as in transformers (its decoder reads the
sliding cache layer, which holds the last W - 1 prefix tokens, then appends the canvas).

The step's metadata lives in one `StepContext`, made once per forward and read by every layer.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """k, v: [layers, slots + 1, max_len, kv_heads, head_dim]; slot index `slots` is the write sink."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots + 1, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def sink(self) -> int:
        return self.num_slots * self.max_len


class LayeredKVCache:
    """A KV cache whose layers differ in shape (DiffusionGemma: sliding layers of 8 KV heads x 256,
    full layers of 2 x 512). k[layer], v[layer]: [slots + 1, max_len, kv_heads_l, head_dim_l]; the
    same slot rows, positions and write sink as KVCache, so StepContext and cached_attention serve both."""

    def __init__(self, shapes: list[tuple[int, int]], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.k = [torch.zeros(num_slots + 1, max_len, h, d, dtype=dtype, device=device) for h, d in shapes]
        self.v = [torch.zeros(num_slots + 1, max_len, h, d, dtype=dtype, device=device) for h, d in shapes]
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def sink(self) -> int:
        return self.num_slots * self.max_len


@dataclass
class StepContext:
    kv: KVCache | LayeredKVCache
    slots: torch.Tensor        # [B] int64
    write_index: torch.Tensor  # [B * L] flat (slot, position) row of each token in a layer's cache
    kv_len: int                # keys read per row: max over rows of start + L
    mask: torch.Tensor         # [B, 1, L, kv_len] bool, True = attend
    window_mask: torch.Tensor | None = None  # [B, 1, L, kv_len] bool for sliding layers; None: no window
    causal_rows: torch.Tensor | None = None  # [B] bool: prefill / commit rows True, denoise rows False

    @classmethod
    def build(cls, kv: KVCache | LayeredKVCache, slots: list[int], starts: list[int], lengths: list[int],
              causal: list[bool], width: int, device: torch.device | str,
              window: int | None = None) -> "StepContext":
        """Rows are host-side lists the scheduler already knows: making the context never syncs.
        `window`: the sliding window W of sliding-attention layers (keys within W of the query, the
        query included; anchored at the canvas start for bidirectional rows)."""
        for s, n in zip(starts, lengths):
            if not 0 < n <= width or s + n > kv.max_len:
                raise ValueError(f"segment [{s}, {s + n}) does not fit width {width} / max_len {kv.max_len}")
        start = torch.tensor(starts, dtype=torch.int64)
        length = torch.tensor(lengths, dtype=torch.int64)
        slot = torch.tensor(slots, dtype=torch.int64)
        is_causal = torch.tensor(causal, dtype=torch.bool)
        i = torch.arange(width)
        token_pos = start[:, None] + i[None, :]                                 # [B, L]
        real = i[None, :] < length[:, None]
        write = torch.where(real, slot[:, None] * kv.max_len + token_pos, kv.sink)
        kv_len = max(s + width for s in starts)
        kv_len = min(kv_len, kv.max_len)
        j = torch.arange(kv_len)[None, None, :]                                 # key positions
        q = token_pos[:, :, None]
        in_segment = (j >= start[:, None, None]) & (j < (start + length)[:, None, None])
        visible = (j < start[:, None, None]) | (in_segment & (~is_causal[:, None, None] | (j <= q)))
        window_mask = None
        if window is not None:
            window_mask = sliding_window_mask(visible, token_pos, start, real, is_causal, window).to(device)
        return cls(kv=kv, slots=slot.to(device), write_index=write.flatten().to(device), kv_len=kv_len,
                   mask=visible.unsqueeze(1).to(device), window_mask=window_mask, causal_rows=is_causal.to(device))


def sliding_window_mask(visible: torch.Tensor, token_pos: torch.Tensor, start: torch.Tensor, real: torch.Tensor,
                        causal: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding layers' mask [B, 1, L, K] from the full one `visible` [B, L, K], the rows' token
    positions [B, L], starts [B], real (non-padding) tokens [B, L] and causal flags [B]. Device ops only
    (a CUDA graph can capture it, as model.graphs.device_context computes its masks)."""
    if window < 1:
        raise ValueError(f"sliding window {window} must be >= 1")
    j = torch.arange(visible.shape[-1], device=visible.device)[None, None, :]
    # causal rows: keys (q - W, q]; bidirectional rows: keys (start - W, ...): the last W - 1 prefix
    # keys and, since start > start - W, the whole canvas
    anchor = torch.where(causal[:, None], token_pos, start[:, None])[:, :, None]
    # padding queries keep their full row: a window past a short row's end would leave them no key at
    # all (a NaN row, which the experts' routing would then read)
    in_window = (j > anchor - window) | ~real[:, :, None]
    return (visible & in_window).unsqueeze(1)


_current: ContextVar[StepContext | None] = ContextVar("step_context", default=None)


@contextlib.contextmanager
def step_context(ctx: StepContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_step_context() -> StepContext:
    ctx = _current.get()
    assert ctx is not None, "attention called outside step_context()"
    return ctx


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                     sliding: bool = False) -> torch.Tensor:
    """q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]. `sliding`: read the context's window mask."""
    ctx = get_step_context()
    cache_k, cache_v = ctx.kv.k[layer], ctx.kv.v[layer]
    assert not sliding or ctx.window_mask is not None, "a sliding layer needs StepContext.build(..., window=W)"
    hkv, d = k.shape[-2:]
    cache_k.view(-1, hkv, d).index_copy_(0, ctx.write_index, k.reshape(-1, hkv, d))
    cache_v.view(-1, hkv, d).index_copy_(0, ctx.write_index, v.reshape(-1, hkv, d))
    keys = cache_k[ctx.slots, : ctx.kv_len]      # [B, K, Hkv, D]
    values = cache_v[ctx.slots, : ctx.kv_len]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=ctx.window_mask if sliding else ctx.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
