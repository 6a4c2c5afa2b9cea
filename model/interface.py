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

from model.attention import KVCache, LayeredKVCache
from model.config import ModelConfig
from model.parallel.group import TPGroup


@dataclass(frozen=True)
class KVLayout:
    """Per layer, (KV heads on this rank, head_dim) and whether it is a sliding-window layer; `window`:
    the sliding layers' W (None: no sliding layers)."""
    shapes: tuple[tuple[int, int], ...]
    sliding: tuple[bool, ...]
    window: int | None = None

    def cache(self, num_slots: int, max_len: int, canvas_length: int, dtype: torch.dtype,
              device: torch.device) -> KVCache | LayeredKVCache:
        """One tensor for layers all alike; per-layer tensors otherwise, sliding layers as rings of the
        window plus one canvas (what a canvas's queries read)."""
        if len(set(self.shapes)) == 1 and not any(self.sliding):
            (heads, head_dim), = set(self.shapes)
            return KVCache(len(self.shapes), num_slots, max_len, heads, head_dim, dtype, device)
        return LayeredKVCache(list(self.shapes), num_slots, max_len, dtype, device, sliding=list(self.sliding),
                              ring=self.window - 1 + canvas_length if self.window else None)


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
