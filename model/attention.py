"""Attention over a per-slot KV cache for the three step kinds (SPEC.md section 1).

One forward carries B rows, each a segment of one slot padded to a common length L:
  prefill  causal over prompt tokens, keys = the slot's cache before it + itself;
  denoise  bidirectional over the canvas, keys = the committed prefix + the whole canvas;
  commit   causal over the finished canvas at the same positions.
Every row's new keys and values are written at their absolute positions in the slot's cache before
attention reads it. For denoise rows those positions lie past the committed prefix, so the write is
scratch that the canvas's commit overwrites: only `prefix_len` positions of a slot are ever valid.
Padding tokens write into a sink row that nothing reads.

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


@dataclass
class StepContext:
    kv: KVCache
    slots: torch.Tensor        # [B] int64
    write_index: torch.Tensor  # [B * L] flat (slot, position) row of each token in a layer's cache
    kv_len: int                # keys read per row: max over rows of start + L
    mask: torch.Tensor         # [B, 1, L, kv_len] bool, True = attend

    @classmethod
    def build(cls, kv: KVCache, slots: list[int], starts: list[int], lengths: list[int], causal: list[bool],
              width: int, device: torch.device | str) -> "StepContext":
        """Rows are host-side lists the scheduler already knows: making the context never syncs."""
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
        return cls(kv=kv, slots=slot.to(device), write_index=write.flatten().to(device), kv_len=kv_len,
                   mask=visible.unsqueeze(1).to(device))


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


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]."""
    ctx = get_step_context()
    cache_k, cache_v = ctx.kv.k[layer], ctx.kv.v[layer]
    hkv, d = k.shape[-2:]
    cache_k.view(-1, hkv, d).index_copy_(0, ctx.write_index, k.reshape(-1, hkv, d))
    cache_v.view(-1, hkv, d).index_copy_(0, ctx.write_index, v.reshape(-1, hkv, d))
    keys = cache_k[ctx.slots, : ctx.kv_len]      # [B, K, Hkv, D]
    values = cache_v[ctx.slots, : ctx.kv_len]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=ctx.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
