"""Attention over a per-slot KV cache for the three step kinds (docs/spec.md section 1), and the step's
metadata every layer reads (`StepContext`, made once per forward with device ops only).

Every row's new keys and values are written at their absolute positions before attention reads them: a
denoise row's land past the committed prefix, scratch its commit overwrites; padding writes a sink row
nothing reads. Sliding layers see a window anchored at the canvas start on denoise rows, and a
LayeredKVCache may hold them as rings of W - 1 + C positions. After a prefill, CUDA reads the cache in
place through model.kernels.attention; elsewhere (and with DLLM_TRITON_ATTENTION=0) each row's keys are
gathered for a masked SDPA, the reference. The cache's layout: docs/design.md, "Memory".
"""
from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import batch_invariant
from model.kernels.launch import INTERPRETED


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
    full layers of 2 x 512). k[layer], v[layer]: [slots + 1, positions, kv_heads_l, head_dim_l], slot
    `slots` the write sink. Full layers hold max_len positions, like KVCache. With `ring` set, sliding
    layers hold a ring of `ring` positions instead (position p at p mod ring): their memory is bounded
    by the window, not the sequence."""

    def __init__(self, shapes: list[tuple[int, int]], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, sliding: list[bool] | None = None, ring: int | None = None):
        sliding = sliding or [False] * len(shapes)
        self.ring_len = ring if ring is not None and any(sliding) else None
        self.rings = [bool(self.ring_len) and s for s in sliding]   # which layers are rings
        lengths = [self.ring_len if r else max_len for r in self.rings]
        self.k = [torch.zeros(num_slots + 1, n, h, d, dtype=dtype, device=device) for (h, d), n in zip(shapes, lengths)]
        self.v = [torch.zeros(num_slots + 1, n, h, d, dtype=dtype, device=device) for (h, d), n in zip(shapes, lengths)]
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def sink(self) -> int:
        return self.num_slots * self.max_len


@dataclass
class RingView:
    """How ring-buffer layers write and read in one step (keys: the whole ring of each row's slot)."""
    write_index: torch.Tensor  # [B * L] flat (slot, position mod ring) of each token; the sink for
                               # padding and for prefill tokens the ring cannot hold
    mask: torch.Tensor | None  # [B, 1, L, ring] bool: key j holds position p_j (see ring_positions)


@dataclass
class StepContext:
    kv: KVCache | LayeredKVCache
    slots: torch.Tensor        # [B] int64
    write_index: torch.Tensor  # [B * L] flat (slot, position) row of each token in a layer's cache
    kv_len: int                # keys read per row: max over rows of start + L
    mask: torch.Tensor         # [B, 1, L, kv_len] bool, True = attend
    window_mask: torch.Tensor | None = None  # [B, 1, L, kv_len] bool for sliding layers; None: no window
    causal_rows: torch.Tensor | None = None  # [B] bool: prefill / commit rows True, denoise rows False
    fresh: bool = False        # every row starts at position 0 (a prefill): attend to the step's own keys
    ring: RingView | None = None  # sliding layers of a ring cache
    starts: torch.Tensor | None = None   # [B] int64: each row's first position
    lengths: torch.Tensor | None = None  # [B] int64: each row's real tokens
    window: int | None = None  # the sliding layers' W

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
        meta = torch.tensor([slots, starts, lengths, [int(c) for c in causal]], dtype=torch.int64, device=device)
        kv_len = min(max(s + width for s in starts), kv.max_len)
        return device_context(kv, meta, width, kv_len, window, fresh=all(s == 0 for s in starts))[0]


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


def sliding_window_mask(visible: torch.Tensor, token_pos: torch.Tensor, start: torch.Tensor, real: torch.Tensor,
                        causal: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding layers' mask [B, 1, L, K] from the full one `visible` [B, L, K], the rows' token
    positions [B, L], starts [B], real (non-padding) tokens [B, L] and causal flags [B]. Device ops only
    (a CUDA graph can capture it, as device_context computes its masks)."""
    if window < 1:
        raise ValueError(f"sliding window {window} must be >= 1")
    j = torch.arange(visible.shape[-1], device=visible.device)[None, None, :]
    return (visible & _in_window(j, token_pos, start, real, causal, window)).unsqueeze(1)


def _in_window(key_pos: torch.Tensor, token_pos: torch.Tensor, start: torch.Tensor, real: torch.Tensor,
               causal: torch.Tensor, window: int) -> torch.Tensor:
    """[B, L, K]: key positions within each query's window."""
    # causal rows: keys (q - W, q]; bidirectional rows: keys (start - W, ...): the last W - 1 prefix
    # keys and, since start > start - W, the whole canvas
    anchor = torch.where(causal[:, None], token_pos, start[:, None])[:, :, None]
    # padding queries keep their full row: a window past a short row's end would leave them no key at
    # all (a NaN row, which the experts' routing would then read)
    return (key_pos > anchor - window) | ~real[:, :, None]


def ring_positions(start: torch.Tensor, width: int, ring: int) -> torch.Tensor:
    """[B, ring]: the position each ring entry holds once a step's rows [start, start + width) are
    written: the latest p < start + width with p = j (mod ring) (negative: never written)."""
    base = (start + width - ring)[:, None]
    j = torch.arange(ring, device=start.device)[None, :]
    return base + torch.remainder(j - base, ring)


def ring_view(kv: LayeredKVCache, slot: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
              pos: torch.Tensor, real: torch.Tensor, causal: torch.Tensor, width: int, window: int,
              fresh: bool) -> RingView:
    R = kv.ring_len
    # a prefill longer than the ring keeps its last R tokens (the earlier ones would be overwritten)
    kept = real & (pos >= (start + length - R)[:, None])
    write = torch.where(kept, slot[:, None] * R + torch.remainder(pos, R), kv.num_slots * R)
    if fresh:  # attention reads the step's own keys, under the full-length window mask
        return RingView(write_index=write.flatten(), mask=None)
    key_pos = ring_positions(start, width, R)[:, None, :]                  # [B, 1, R]
    q = pos[:, :, None]
    first, end = start[:, None, None], (start + length)[:, None, None]
    written = (key_pos >= 0) & (key_pos < end)
    visible = (key_pos < first) | (~causal[:, None, None] | (key_pos <= q))
    mask = written & visible & _in_window(key_pos, pos, start, real, causal, window)
    return RingView(write_index=write.flatten(), mask=mask.unsqueeze(1))


_current: ContextVar[StepContext | None] = ContextVar("step_context", default=None)
# Steps after a prefill on CUDA read the cache in place through model.kernels.attention instead of
# gathering it for a masked SDPA, several times faster (docs/kernels.md).
# DLLM_TRITON_ATTENTION=0 (or triton_attention(False)) turns it off.
_triton = os.environ.get("DLLM_TRITON_ATTENTION", "1") != "0"


@contextlib.contextmanager
def triton_attention(on: bool = True):
    """cached_attention's steps after a prefill through the triton kernel (or not) inside the block, on
    CUDA tensors (and on CPU ones under triton's interpreter, for the tests)."""
    global _triton
    previous, _triton = _triton, on
    try:
        yield
    finally:
        _triton = previous


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


@dataclass
class KVRows:
    """Where one layer's keys and values of this step go: row `index[t]` of `k` and `v` ([cache rows,
    Hkv, D] views of the layer's cache) for token t of the step's [B * L]."""
    k: torch.Tensor
    v: torch.Tensor
    index: torch.Tensor

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, L, Hkv, D]."""
        hkv, d = k.shape[-2:]
        self.k.index_copy_(0, self.index, k.reshape(-1, hkv, d))
        self.v.index_copy_(0, self.index, v.reshape(-1, hkv, d))


def _ring_of(ctx: StepContext, layer: int) -> RingView | None:
    """The step's ring view if `layer` is a ring layer of the cache."""
    return ctx.ring if ctx.ring is not None and ctx.kv.rings[layer] else None


def kv_rows(layer: int) -> KVRows:
    """This step's KVRows for `layer` (a ring layer writes position p at p mod ring)."""
    ctx = get_step_context()
    cache_k, cache_v = ctx.kv.k[layer], ctx.kv.v[layer]
    ring = _ring_of(ctx, layer)
    hkv, d = cache_k.shape[-2:]
    return KVRows(cache_k.view(-1, hkv, d), cache_v.view(-1, hkv, d),
                  ring.write_index if ring is not None else ctx.write_index)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                     sliding: bool = False, stored: bool = False) -> torch.Tensor:
    """q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]. `sliding`: a sliding-window layer (its
    window mask; its ring when the cache has rings). `stored`: k and v are in the cache already (the
    per-head kernel that made them wrote them there, through kv_rows)."""
    ctx = get_step_context()
    cache_k, cache_v = ctx.kv.k[layer], ctx.kv.v[layer]
    assert not sliding or ctx.window_mask is not None, "a sliding layer needs StepContext.build(..., window=W)"
    ring = _ring_of(ctx, layer)
    if not stored:
        kv_rows(layer).store(k, v)
    # fp64 (the tests' references) is a dtype the kernel does not take: SDPA below
    if _triton and not ctx.fresh and (q.is_cuda or INTERPRETED) and q.dtype != torch.float64:
        return _kernel_attention(ctx, q, cache_k, cache_v, ring is not None, sliding, scale)
    if ctx.fresh:      # a prefill: its own keys are every key it reads
        keys, values = k, v
        mask = ctx.window_mask if sliding else ctx.mask
    elif ring is not None:
        keys, values, mask = cache_k[ctx.slots], cache_v[ctx.slots], ring.mask
    else:
        keys, values = cache_k[ctx.slots, : ctx.kv_len], cache_v[ctx.slots, : ctx.kv_len]   # [B, K, Hkv, D]
        mask = ctx.window_mask if sliding else ctx.mask
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if q.is_cuda and (q.shape[-1] > 256 or batch_invariant.enabled() or (sliding and q.shape[0] == 1)):
        # flash and cuDNN take head_dim <= 256; the memory-efficient kernel (GQA heads repeated for it)
        # beats the math fallback at DiffusionGemma's 512. It is also the batch-invariant one (per query
        # block, keys in order), and with a mask over a sliding layer's ring at batch 1 it is faster than
        # cuDNN
        repeat = q.shape[1] // keys.shape[1]
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(q, keys.repeat_interleave(repeat, 1),
                                                 values.repeat_interleave(repeat, 1), attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _kernel_attention(ctx: StepContext, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, ring: bool,
                      sliding: bool, scale: float) -> torch.Tensor:
    """cached_attention's keys and masks, read in place by model.kernels.attention: a ring layer its ring
    under the window, others the slot's first kv_len positions. (A prefill keeps SDPA over its own
    keys: there is nothing to gather, and flash attention is as fast there.)"""
    from model.kernels.attention import attention

    meta = (ctx.slots, ctx.starts, ctx.lengths, ctx.causal_rows)
    invariant = batch_invariant.enabled()
    if ring:   # the ring's mask always carries the window
        return attention(q, cache_k, cache_v, *meta, scale, ctx.window, ring=ctx.kv.ring_len, invariant=invariant)
    return attention(q, cache_k, cache_v, *meta, scale, ctx.window if sliding else None, keys=ctx.kv_len,
                     invariant=invariant)
