"""Attention over a paged KV cache for the three step kinds (docs/spec.md section 1), and the step's
metadata every layer reads (`StepContext`, made once per forward with device ops only).

Keys and values live in pages of `page_size` positions; a slot's page table maps its position p to page
table[p // page_size], per layer group (full-attention layers; sliding-window layers, whose pages behind
the window the scheduler takes back). Every row's new keys and values are written at their positions
before attention reads them: a denoise row's land past the committed prefix, scratch its commit
overwrites; padding writes the sink page nothing reads. After a prefill, CUDA reads the pages in place
through model.kernels.attention; elsewhere (and with DLLM_TRITON_ATTENTION=0) each row's pages are
gathered for a masked SDPA, the reference. The layout: docs/design.md, "Memory".
"""
from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import batch_invariant
from model.kernels.launch import INTERPRETED
from model.protocol import PAGE_SIZE


class PagedKVCache:
    """k[l], v[l]: [(pages_g + 1) * page_size, kv_heads_l, head_dim_l] rows of layer l, in layer group
    g = group_of[l]; the group's last page is its sink. page_table[g]: [slots + 1, max_pages] int64, the
    page of each slot's page index (the sink where it holds none; row `slots` is the padding slot's).
    `windows[g]`: the group's sliding window (None: full attention)."""

    def __init__(self, shapes: list[tuple[int, int]], group_of: list[int], num_pages: list[int],
                 windows: list[int | None], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, page_size: int = PAGE_SIZE):
        assert len(shapes) == len(group_of) and len(num_pages) == len(windows) == max(group_of) + 1
        self.page_size, self.num_slots, self.max_len = page_size, num_slots, max_len
        self.max_pages = -(-max_len // page_size)
        self.group_of, self.num_pages, self.windows = list(group_of), list(num_pages), list(windows)
        rows = [(n + 1) * page_size for n in num_pages]
        self.k = [torch.zeros(rows[g], h, d, dtype=dtype, device=device) for (h, d), g in zip(shapes, group_of)]
        self.v = [torch.zeros(rows[g], h, d, dtype=dtype, device=device) for (h, d), g in zip(shapes, group_of)]
        self.page_table = [torch.full((num_slots + 1, self.max_pages), n, dtype=torch.int64, device=device)
                           for n in num_pages]

    @classmethod
    def per_slot(cls, shapes: list[tuple[int, int]], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, sliding: list[bool] | None = None, window: int | None = None,
                 page_size: int = PAGE_SIZE) -> "PagedKVCache":
        """Every slot its own pages for max_len positions in every group (slot s's page i is s * max_pages
        + i), for a runner whose pages no scheduler manages, and for tests."""
        sliding = sliding or [False] * len(shapes)
        kinds = sorted(set(sliding))                    # [False], [True] or [False, True]
        group_of = [kinds.index(s) for s in sliding]
        max_pages = -(-max_len // page_size)
        kv = cls(shapes, group_of, [num_slots * max_pages] * len(kinds), [window if s else None for s in kinds],
                 num_slots, max_len, dtype, device, page_size)
        own = torch.arange(num_slots * max_pages, dtype=torch.int64, device=device).view(num_slots, max_pages)
        for table in kv.page_table:
            table[:num_slots] = own
        return kv

    @property
    def nbytes(self) -> int:
        """The pool's device memory: every layer's keys and values, sink pages included."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def sink(self, group: int) -> int:
        """The first row of a group's sink page."""
        return self.num_pages[group] * self.page_size

    def clear_pages(self, slots: torch.Tensor) -> None:
        """Every entry of `slots`' page tables the sink. Device ops only."""
        for table, sink_page in zip(self.page_table, self.num_pages):
            table.index_fill_(0, slots, sink_page)

    def write_pages(self, group: int, flat: torch.Tensor, pages: torch.Tensor) -> None:
        """Entries `flat` (slot * max_pages + page index) of a group's page table become `pages` (-1: the
        sink). Device ops only."""
        pages = torch.where(pages < 0, self.num_pages[group], pages)
        self.page_table[group].view(-1).index_copy_(0, flat, pages)


@dataclass
class StepContext:
    kv: PagedKVCache
    slots: torch.Tensor        # [B] int64
    write_index: list[torch.Tensor]   # per group: [B * L] the cache row of each token (the sink for padding)
    pages: list[torch.Tensor]  # per group: [B, ceil(kv_len / page_size)] the pages of each row's keys
    kv_len: int                # keys read per row: max over rows of start + L
    # (mask, window_mask) on first use: [B, 1, L, kv_len] bool, True = attend, and the sliding layers'
    # (None: no window). The paths that gather keys read them; the paged kernel reads the rows' starts
    # and lengths instead, so a graph over the cache's whole length never builds them
    masks: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    causal_rows: torch.Tensor | None = None  # [B] bool: prefill / commit rows True, denoise rows False
    fresh: bool = False        # every row starts at position 0 (a prefill): attend to the step's own keys
    starts: torch.Tensor | None = None   # [B] int64: each row's first position
    lengths: torch.Tensor | None = None  # [B] int64: each row's real tokens
    window: int | None = None  # the sliding layers' W
    # sliding layers after a prefill: each row's pages from its window's first on, and the mask over them
    window_pages: torch.Tensor | None = None   # [B, n] page ids (the sliding group's)
    window_keys_mask: torch.Tensor | None = None   # [B, 1, L, n * page_size] bool
    _masks: tuple | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor:
        return self._built()[0]

    @property
    def window_mask(self) -> torch.Tensor | None:
        return self._built()[1]

    def _built(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._masks is None:
            self._masks = self.masks()
        return self._masks

    @classmethod
    def build(cls, kv: PagedKVCache, slots: list[int], starts: list[int], lengths: list[int],
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


def device_context(kv: PagedKVCache, meta: torch.Tensor, width: int, kv_len: int, window: int | None = None,
                   fresh: bool = False) -> tuple[StepContext, torch.Tensor]:
    """The StepContext of rows described by `meta` [4, B] (slots, starts, lengths, causal), computed
    with device ops only (no host values, so it can be captured). Returns it and positions [B, width].
    `window`: the sliding window of sliding-attention layers (DiffusionGemma), None for none;
    `fresh`: every row starts at 0 (a prefill), so attention reads the step's own keys."""
    slot, start, length, causal = meta[0], meta[1], meta[2], meta[3].bool()
    P = kv.page_size
    i = torch.arange(width, device=meta.device)
    pos = start[:, None] + i[None, :]
    real = i[None, :] < length[:, None]
    page_index = torch.clamp(pos // P, max=kv.max_pages - 1)   # padding past max_len reads a real entry
    write, pages = [], []
    for g, table in enumerate(kv.page_table):
        rows = table[slot]                                                   # [B, max_pages]
        write.append(torch.where(real, rows.gather(1, page_index) * P + pos % P, kv.sink(g)).flatten())
        pages.append(rows[:, : -(-kv_len // P)])
    def masks() -> tuple[torch.Tensor, torch.Tensor | None]:
        j = torch.arange(kv_len, device=meta.device)[None, None, :]
        visible = _visible(j, start, length, causal, pos)
        window_mask = None if window is None else sliding_window_mask(visible, pos, start, real, causal, window)
        return visible.unsqueeze(1), window_mask

    window_pages = window_keys_mask = None
    if window is not None and not fresh and window in kv.windows:
        # the pages from the window's first on, as many as the window and the step span: what a sliding
        # layer reads, whatever the other rows' lengths (a ring's worth, not the whole prefix)
        group = kv.windows.index(window)
        first_page = torch.clamp(start - window + 1, min=0) // P
        n = -(-(window - 1 + width) // P) + 1
        index = first_page[:, None] + torch.arange(n, device=meta.device)[None, :]                  # [B, n]
        window_pages = kv.page_table[group][slot].gather(1, torch.clamp(index, max=kv.max_pages - 1))
        key_pos = (index[:, :, None] * P + torch.arange(P, device=meta.device)).flatten(1)[:, None, :]   # [B, 1, nP]
        seen = _visible(key_pos, start, length, causal, pos) & (key_pos < kv.max_len)
        window_keys_mask = sliding_window_mask(seen, pos, start, real, causal, window, key_pos)
    ctx = StepContext(kv=kv, slots=slot, write_index=write, pages=pages, kv_len=kv_len, masks=masks,
                      causal_rows=causal, fresh=fresh, starts=start, lengths=length,
                      window=window, window_pages=window_pages, window_keys_mask=window_keys_mask)
    return ctx, pos


def _visible(key_pos: torch.Tensor, start: torch.Tensor, length: torch.Tensor, causal: torch.Tensor,
             token_pos: torch.Tensor) -> torch.Tensor:
    """[B, L, K]: keys at `key_pos` ([1 or B, 1, K]) each query sees, windows aside: the prefix before the
    row, and the row's own keys (causal rows: up to the query)."""
    first, end = start[:, None, None], (start + length)[:, None, None]
    in_segment = (key_pos >= first) & (key_pos < end)
    return (key_pos < first) | (in_segment & (~causal[:, None, None] | (key_pos <= token_pos[:, :, None])))


def sliding_window_mask(visible: torch.Tensor, token_pos: torch.Tensor, start: torch.Tensor, real: torch.Tensor,
                        causal: torch.Tensor, window: int, key_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The sliding layers' mask [B, 1, L, K] from the full one `visible` [B, L, K] over keys at `key_pos`
    ([1 or B, 1, K]; default 0 .. K - 1), the rows' token positions [B, L], starts [B], real (non-padding)
    tokens [B, L] and causal flags [B]. Device ops only (a CUDA graph can capture it, as device_context
    computes its masks)."""
    if window < 1:
        raise ValueError(f"sliding window {window} must be >= 1")
    j = torch.arange(visible.shape[-1], device=visible.device)[None, None, :] if key_pos is None else key_pos
    # causal rows: keys (q - W, q]; bidirectional rows: keys (start - W, ...): the last W - 1 prefix
    # keys and, since start > start - W, the whole canvas
    anchor = torch.where(causal[:, None], token_pos, start[:, None])[:, :, None]
    # padding queries keep their full row: a window past a short row's end would leave them no key at
    # all (a NaN row, which the experts' routing would then read)
    return (visible & ((j > anchor - window) | ~real[:, :, None])).unsqueeze(1)


_current: ContextVar[StepContext | None] = ContextVar("step_context", default=None)
# Steps after a prefill on CUDA read the pages in place through model.kernels.attention instead of
# gathering them for a masked SDPA (docs/kernels.md). DLLM_TRITON_ATTENTION=0 (or triton_attention(False))
# turns it off.
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
    """Where one layer's keys and values of this step go: row `index[t]` of `k` and `v` (a layer's
    [cache rows, Hkv, D]) for token t of the step's [B * L]."""
    k: torch.Tensor
    v: torch.Tensor
    index: torch.Tensor

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, L, Hkv, D]."""
        hkv, d = k.shape[-2:]
        self.k.index_copy_(0, self.index, k.reshape(-1, hkv, d))
        self.v.index_copy_(0, self.index, v.reshape(-1, hkv, d))


def kv_rows(layer: int) -> KVRows:
    """This step's KVRows for `layer`."""
    ctx = get_step_context()
    return KVRows(ctx.kv.k[layer], ctx.kv.v[layer], ctx.write_index[ctx.kv.group_of[layer]])


def gather_keys(cache: torch.Tensor, pages: torch.Tensor, page_size: int, kv_len: int) -> torch.Tensor:
    """A layer's cache rows [(pages + 1) * page_size, Hkv, D] of each row's `pages` [B, n], in position order,
    its first kv_len: [B, kv_len, Hkv, D], contiguous (SDPA's CPU kernels then sum each row alike in any
    batch, as over a slot's own contiguous keys)."""
    hkv, d = cache.shape[1:]
    return cache.view(-1, page_size, hkv, d)[pages].flatten(1, 2)[:, :kv_len].contiguous()


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                     sliding: bool = False, stored: bool = False) -> torch.Tensor:
    """q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]. `sliding`: a sliding-window layer (its
    window mask). `stored`: k and v are in the cache already (the per-head kernel that made them wrote
    them there, through kv_rows)."""
    ctx = get_step_context()
    kv = ctx.kv
    group = kv.group_of[layer]
    cache_k, cache_v = kv.k[layer], kv.v[layer]
    assert not sliding or ctx.window is not None, "a sliding layer needs StepContext.build(..., window=W)"
    if not stored:
        kv_rows(layer).store(k, v)
    # fp64 (the tests' references) is a dtype the kernel does not take: SDPA below. In the batch-invariant
    # mode a prefill from position 0 reads its keys through the cache too, so a prompt's KV and prediction
    # have the same bits prefilled whole, in chunks, or past a cached prefix (one kernel, keys in order)
    fresh = ctx.fresh and not batch_invariant.enabled()
    if _triton and not fresh and (q.is_cuda or INTERPRETED) and q.dtype != torch.float64:
        from model.kernels.attention import attention

        return attention(q, cache_k, cache_v, ctx.slots, ctx.starts, ctx.lengths, ctx.causal_rows, scale,
                         ctx.window if sliding else None, keys=ctx.kv_len, page_table=kv.page_table[group],
                         page_size=kv.page_size, invariant=batch_invariant.enabled())
    mask = ctx.window_mask if sliding else ctx.mask
    if ctx.fresh:      # a prefill: its own keys are every key it reads
        keys, values = k, v
    elif sliding and ctx.window_pages is not None:   # its window's pages: [B, n * page_size, Hkv, D]
        n = ctx.window_pages.shape[1] * kv.page_size
        keys, values = (gather_keys(c, ctx.window_pages, kv.page_size, n) for c in (cache_k, cache_v))
        mask = ctx.window_keys_mask
    else:              # each row's pages, in order: [B, kv_len, Hkv, D]
        keys, values = (gather_keys(c, ctx.pages[group], kv.page_size, ctx.kv_len) for c in (cache_k, cache_v))
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if q.is_cuda and (q.shape[-1] > 256 or batch_invariant.enabled() or (sliding and q.shape[0] == 1)):
        # flash and cuDNN take head_dim <= 256; the memory-efficient kernel (GQA heads repeated for it)
        # beats the math fallback at DiffusionGemma's 512. It is also the batch-invariant one (per query
        # block, keys in order), and with a window mask at batch 1 it is faster than cuDNN
        repeat = q.shape[1] // keys.shape[1]
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(q, keys.repeat_interleave(repeat, 1),
                                                 values.repeat_interleave(repeat, 1), attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
