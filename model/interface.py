"""What the runner needs of a family's model (one tensor-parallel rank of it), declared once.

    hidden = model(ids [B, L], positions [B, L], soft [B, L, H] | None)   inside an attention step_context
    logits = model.head_logits(hidden)        this rank's vocabulary slice [vocab_start, vocab_start + V_r)
    cache  = model.kv_layout.cache(...)       the KV cache its attention layers read and write

`soft` is the self-conditioning signal of a family that has one (SelfConditionedLM), None elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from model.attention import PagedKVCache
from model.config import ModelConfig
from model.parallel.group import TPGroup
from model.protocol import PAGE_SIZE


@dataclass(frozen=True)
class KVLayout:
    """Per layer, (KV heads on this rank, head_dim) and whether it is a sliding-window layer; `window`:
    the sliding layers' W (None: no sliding layers). Layers of one kind share page tables: a group."""
    shapes: tuple[tuple[int, int], ...]
    sliding: tuple[bool, ...]
    window: int | None = None

    @property
    def group_windows(self) -> list[int | None]:
        """Each layer group's window, full-attention layers' group first (None)."""
        return [self.window if s else None for s in sorted(set(self.sliding))]

    def page_bytes(self, dtype: torch.dtype, page_size: int = PAGE_SIZE) -> list[int]:
        """Per group, the bytes a page of its layers' keys and values takes."""
        kinds = sorted(set(self.sliding))
        size = torch.empty((), dtype=dtype).element_size()
        return [sum(2 * h * d * page_size * size for (h, d), s in zip(self.shapes, self.sliding) if s == kind)
                for kind in kinds]

    def cache(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
              num_pages: list[int] | None = None, page_size: int = PAGE_SIZE) -> PagedKVCache:
        """The paged cache: `num_pages` per group, whose page tables the scheduler sets; None: every slot
        its own pages for max_len positions."""
        if num_pages is None:
            return PagedKVCache.per_slot(list(self.shapes), num_slots, max_len, dtype, device, list(self.sliding),
                                         self.window, page_size)
        kinds = sorted(set(self.sliding))
        return PagedKVCache(list(self.shapes), [kinds.index(s) for s in self.sliding], num_pages, self.group_windows,
                            num_slots, max_len, dtype, device, page_size)


@runtime_checkable
class DiffusionLM(Protocol):
    config: ModelConfig
    tp: TPGroup

    @property
    def vocab_start(self) -> int: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    @property
    def logit_softcap(self) -> float | None:
        """c of the sampler's c * tanh(logits / c) (docs/spec.md 4.1); None: the raw logits."""

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, soft: torch.Tensor | None = None) -> torch.Tensor: ...

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SelfConditionedLM(DiffusionLM, Protocol):
    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., V_r] this rank's slice of softmax(logits / T) -> the next step's `soft` [..., H]."""
