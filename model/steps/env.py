"""What every step kind reads and writes, and nothing else of the runner: the model and its KV cache,
the slots' device state, the command's outputs and drafts, and the sampler.

    hidden = env.forward(idx, tokens, starts, width, causal, kv_len)   rows idx of the slot table
    logits = env.logits(hidden)                                         this rank's slice, mask token -inf

A step kind is a callable `step(plan, idx, scored)` over rows `idx` of the slot table (model/steps/plan.py)
that updates their device state with device ops only; canvas-wide kinds also `start` canvases
(CanvasStep below), which the causal steps call after a prefill or a commit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from model.attention import PagedKVCache, device_context, step_context
from model.interface import DiffusionLM
from model.drafts import DraftBuffer
from model.outputs import CommandOutputs
from model.sampling.params import DecodeParams
from model.slots import SlotTable
from model.steps.plan import RowPlan
from model.steps.sampler import RowSampler


@dataclass
class StepEnv:
    model: DiffusionLM
    kv: PagedKVCache
    slots: SlotTable
    outputs: CommandOutputs
    drafts: DraftBuffer
    sampler: RowSampler
    eos: torch.Tensor                    # [E] int64 ids that end a request (but with ignore_eos)
    dtype: torch.dtype                   # the model's (and its KV cache's)
    # tests watch steps through this: observer(event, kind, idx, logits) before ("before", with the
    # step's raw logits) and after ("after") each step's state update; steps then run eagerly
    observer: Callable | None = None

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @property
    def C(self) -> int:
        return self.slots.C

    @property
    def mask_id(self) -> int | None:
        """The mask token; None for uniform-noise canvases."""
        return self.model.config.mask_token_id

    @property
    def tp(self):
        return self.model.tp

    def forward(self, idx: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor, width: int,
                causal: torch.Tensor, kv_len: int, lengths: torch.Tensor | None = None,
                soft: torch.Tensor | None = None, fresh: bool = False) -> torch.Tensor:
        """Rows idx [B] of tokens [B, width] at positions starts + [0, width) (real up to `lengths`,
        default all) -> hidden [B, width, H]; `fresh`: a prefill (every start 0). Device ops only."""
        lengths = torch.full_like(starts, width) if lengths is None else lengths
        meta = torch.stack([idx, starts, lengths, causal.long()])
        ctx, positions = device_context(self.kv, meta, width, kv_len, self.model.kv_layout.window, fresh)
        with step_context(ctx):
            return self.model(tokens, positions, soft)

    def logits(self, hidden: torch.Tensor, idx: torch.Tensor | None = None, spans: tuple[int, ...] = ()) -> torch.Tensor:
        """This rank's raw logits [..., V_r] (the LM head's dtype), the mask token's -inf (never predicted);
        with the rows' slots idx ([B, W, H] hidden), a constrained row's grammar position limited to the
        tokens its grammar allows (the rest -inf), and rows `spans` at each position of their span."""
        x = self.model.head_logits(hidden)
        if self.mask_id is not None:
            local = self.mask_id - self.model.vocab_start
            if 0 <= local < x.shape[-1]:
                x[..., local] = -torch.inf
        if idx is not None:
            self._constrain(x, idx, spans)
        return x

    def _constrain(self, x: torch.Tensor, idx: torch.Tensor, spans: tuple[int, ...]) -> None:
        """Device data only, in every step (an unconstrained row's position is -1 and keeps its logits
        bit for bit), so constrained requests change no step's code (docs/spec.md 12): each row's first
        limited position. Rows `spans` (a constrained verify, eager steps only) at every position of their
        span too, each with its own allowed tokens: [rows, W, V_r] of work, which graphs never do."""
        t = self.slots
        pos = t.grammar_pos[idx]
        ids = torch.arange(self.model.vocab_start, self.model.vocab_start + x.shape[-1], device=x.device)
        rows = torch.arange(x.shape[0], device=x.device)
        col = pos.clamp(0, x.shape[1] - 1)
        allowed = allowed_ids(t.grammar_bits[idx, 0], ids) | (pos < 0)[:, None]          # [B, V_r]
        x[rows, col] = torch.where(allowed, x[rows, col], -torch.inf)
        if not spans:
            return
        r = torch.tensor(spans, device=x.device)
        width = t.grammar_bits.shape[1]
        k = torch.arange(x.shape[1], device=x.device) - pos[r][:, None]                    # [R, W]
        on = (pos[r] >= 0)[:, None] & (k >= 0) & (k < t.grammar_span[idx[r]][:, None])
        bits = t.grammar_bits[idx[r]]                                                     # [R, width, words]
        words = bits.gather(1, k.clamp(0, width - 1)[..., None].expand(-1, -1, bits.shape[-1]))
        allowed = allowed_ids(words, ids) | ~on[..., None]                                 # [R, W, V_r]
        x[r] = torch.where(allowed, x[r], -torch.inf)

    def observe(self, event: str, kind: str, idx: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        if self.observer is not None:
            self.observer(event, kind, idx, logits)


def allowed_ids(words: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Bits [..., words] (a bit per vocabulary id, 32 a word) -> [..., len(ids)]: whether each of `ids` is set."""
    return ((words[..., ids >> 5] >> (ids & 31)) & 1).bool()


class CanvasStep(Protocol):
    """A family's canvas-wide step kind (model/families.py names it): denoise, commit and its other phases
    for every row at once."""

    # whether a new canvas starts from the preceding causal pass's prediction (masked diffusion's seeded
    # position 0, docs/spec.md 3(a)); uniform noise needs none, and its prefill computes no logits
    needs_prediction: bool

    def __init__(self, env: StepEnv) -> None: ...

    def knobs(self, params: DecodeParams) -> dict:
        """The family's per-request knobs (a ValueError naming a bad one); their "gamma" goes to the slot
        table (model/slots.py)."""

    def admit(self, slots: list[int], knobs: list[dict]) -> None:
        """Writes newly admitted slots' family state."""

    def start(self, idx: torch.Tensor, where: torch.Tensor, prediction: torch.Tensor | None) -> None:
        """Rows idx where `where` [B]: a new canvas (after a prefill or a commit), from `prediction` [B]
        (the causal pass's next token) where the family seeds canvases with it."""

    def __call__(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor) -> None: ...
