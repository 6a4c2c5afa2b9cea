"""Per-slot state of one rank's runner (docs/spec.md 1): every request's decoding parameters and decoding
state, in slot-indexed device buffers.

The device state is the truth. Phases, lengths, step counters, canvases and reveal-time scores change
inside a multi-step command without the host reading them (the step kinds in model/steps update them
with device ops only); the runner copies what the host needs once per command. The host keeps only
what it admitted (`SlotInfo`) and the last copied lengths, phases, denoising steps and emitted counts
(what the scheduler's step bounds read, model/phases.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from model.phases import DONE, IDLE
from model.sampling.params import MAX_LOGPROBS, DecodeParams
from model.sampling.reveal import POLICY_IDS


class ScoreBuffer:
    """Per slot and position: logprob, rank and up to MAX_LOGPROBS alternatives of a revealed token."""

    def __init__(self, num_slots: int, width: int, device):
        self.logprob = torch.zeros(num_slots, width, device=device)
        self.rank = torch.zeros(num_slots, width, dtype=torch.int64, device=device)
        self.top_values = torch.full((num_slots, width, MAX_LOGPROBS), -torch.inf, device=device)
        self.top_ids = torch.zeros(num_slots, width, MAX_LOGPROBS, dtype=torch.int64, device=device)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.logprob, self.rank, self.top_values, self.top_ids

    def write(self, slots: torch.Tensor, where: torch.Tensor, scores: "Scores") -> None:
        """Rows `slots`, positions where `where` [R, P] is True (P = the buffer's width)."""
        self.logprob[slots] = torch.where(where, scores.logprob, self.logprob[slots])
        self.rank[slots] = torch.where(where, scores.rank, self.rank[slots])
        if scores.top_values is not None:
            k, w = scores.top_values.shape[-1], where.unsqueeze(-1)
            self.top_values[slots, :, :k] = torch.where(w, scores.top_values, self.top_values[slots, :, :k])
            self.top_ids[slots, :, :k] = torch.where(w, scores.top_ids, self.top_ids[slots, :, :k])

    def read(self, slots: torch.Tensor, k: int) -> "Scores":
        return Scores(self.logprob[slots], self.rank[slots], self.top_values[slots, :, :k] if k else None,
                      self.top_ids[slots, :, :k] if k else None)


@dataclass
class Scores:
    """Scores of R rows x P positions: logprob/rank [R, P], top values/ids [R, P, k] (None when k = 0)."""
    logprob: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    @property
    def k(self) -> int:
        """Alternatives per position: from the shape, not a plan's int, so a compiled update
        (model/steps/compiled.py) serves every k > 1 with one variant."""
        return 0 if self.top_values is None else self.top_values.shape[-1]

    def at(self, column: torch.Tensor) -> "Scores":
        """One position per row: column [R] -> Scores of [R, 1]."""
        def pick(t):
            if t is None:
                return None
            index = column.view(-1, 1, *([1] * (t.dim() - 2))).expand(-1, 1, *t.shape[2:])
            return torch.gather(t, 1, index)
        return Scores(pick(self.logprob), pick(self.rank), pick(self.top_values), pick(self.top_ids))

    def where(self, cond: torch.Tensor, other: "Scores") -> "Scores":
        """These scores where `cond` [R, P] (broadcast over positions and alternatives), `other`'s elsewhere."""
        def pick(a, b):
            return None if a is None else torch.where(cond.view(*cond.shape, *[1] * (a.dim() - 2)), a, b)
        return Scores(pick(self.logprob, other.logprob), pick(self.rank, other.rank),
                      pick(self.top_values, other.top_values), pick(self.top_ids, other.top_ids))

    def expand(self, width: int) -> "Scores":
        """[R, 1] -> [R, width] (the same scores at every position)."""
        def grow(t):
            return None if t is None else t.expand(t.shape[0], width, *t.shape[2:])
        return Scores(grow(self.logprob), grow(self.rank), grow(self.top_values), grow(self.top_ids))


@dataclass(frozen=True)
class SlotInfo:
    """What the host admitted a slot with."""
    params: DecodeParams
    prompt: tuple[int, ...]
    cached: int = 0    # the prompt's positions whose KV its pages held at admission

    @property
    def wants_scores(self) -> bool:
        return self.params.logprobs is not None


@dataclass(frozen=True)
class Admission:
    """What a slot is admitted with: its request's parameters and what the runner decided for it."""
    params: DecodeParams
    seed: int           # the request's seed, or one the scheduler drew
    steps_limit: int    # N: the most denoising steps of one canvas (model/phases.py)
    gamma: float        # the entropy bound (the masked entropy_bound policy's, or DiffusionGemma's)


# The per-slot parameter buffers, in one table: name -> (dtype, its value for an Admission). Every step
# reads them as device data, so a request's options never change which code a step runs.
SLOT_PARAMS: dict[str, tuple[torch.dtype, Callable[[Admission], float]]] = {
    "max_tokens": (torch.int64, lambda a: a.params.max_tokens),
    "steps_limit": (torch.int64, lambda a: a.steps_limit),
    "policy": (torch.int64, lambda a: POLICY_IDS[a.params.policy]),
    "seed": (torch.int64, lambda a: a.seed),
    "top_k": (torch.int64, lambda a: a.params.top_k),
    "temperature": (torch.float32, lambda a: a.params.effective_temperature),
    "top_p": (torch.float32, lambda a: a.params.top_p),
    "tau": (torch.float32, lambda a: a.params.threshold),
    "gamma": (torch.float32, lambda a: a.gamma),
    "ignore_eos": (torch.bool, lambda a: a.params.ignore_eos),
    "early_stop": (torch.bool, lambda a: a.params.eos_early_stop and not a.params.ignore_eos),
    "seed_first": (torch.bool, lambda a: a.params.seed_first_position),
    # a grammar limits the request's text (docs/spec.md 12): its last canvas commits, checked first
    "constrained": (torch.bool, lambda a: a.params.grammar is not None),
    # k of the top alternatives the request asked for; -1: no scores (the sampler's scored passes skip it)
    "logprobs": (torch.int64, lambda a: -1 if a.params.logprobs is None else a.params.logprobs),
}


class SlotTable:
    """Slots 0..num_slots-1 hold requests. One more row, `pad`, is the padding row of CUDA graphs whose
    batch size exceeds the step's rows (model/graphs.py): it is always DONE, so every step computes it and
    keeps nothing, and in the KV cache it is the write sink's slot (model/attention.py)."""

    def __init__(self, num_slots: int, canvas_length: int, fill_token: int, device: torch.device,
                 vocab_size: int = 1, grammar_width: int = 1):
        S, C, dev = num_slots + 1, canvas_length, device
        self.num_slots, self.pad, self.C, self.device = num_slots, num_slots, C, dev
        zeros = lambda dtype=torch.int64: torch.zeros(S, dtype=dtype, device=dev)  # noqa: E731
        # decoding state
        self.phase, self.length, self.n, self.draws, self.emitted = (zeros() for _ in range(5))
        self.last_token = zeros()          # AR: the token fed next; linear speculation: the next seed
        self.canvas = torch.full((S, C), fill_token, dtype=torch.int64, device=dev)
        self.canvas_scores = ScoreBuffer(S, C, dev)   # reveal-time scores of the canvas being denoised
        self.seed_scores = ScoreBuffer(S, 1, dev)     # linear speculation: the score of the next seed
        for name, (dtype, _) in SLOT_PARAMS.items():
            setattr(self, name, zeros(dtype))
        # structured output (model/grammar/guide.py): the first position of a row whose candidates the grammar
        # limits (-1: none), how many from it (a frontier: 1; a verify: every valid draft position), and their
        # allowed tokens, a bit each of the whole vocabulary, for as many positions as the family's steps
        # constrain at once (grammar_width: 1, or a canvas for linear speculation's verify)
        self.grammar_pos = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.grammar_span = torch.ones(S, dtype=torch.int64, device=dev)
        self.grammar_bits = torch.full((S, grammar_width, -(-vocab_size // 32)), -1, dtype=torch.int32, device=dev)
        # uniform-noise canvases only: the positions of the argmax canvas the host found valid (-1: no grammar),
        # whether those make the whole text (the canvas may converge), and tokens pinned past N (-1: none)
        self.grammar_valid = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.grammar_done = torch.zeros(S, dtype=torch.bool, device=dev)
        self.grammar_fixed = torch.full((S, C), -1, dtype=torch.int64, device=dev)
        self.phase[self.pad] = DONE
        self.info: dict[int, SlotInfo] = {}
        # the host's copy of the device state, as of the end of the last command
        self.host_length = [0] * S
        self.host_phase = [IDLE] * S
        self.host_n = [0] * S
        self.host_emitted = [0] * S

    def admit(self, slots: list[int], admissions: list[Admission]) -> None:
        """Writes the parameters of newly admitted slots: one host-to-device copy per dtype, no sync."""
        pinned = self.device.type == "cuda"
        idx = torch.tensor(slots, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        for dtype in dict.fromkeys(dtype for dtype, _ in SLOT_PARAMS.values()):
            names = [name for name, (d, _) in SLOT_PARAMS.items() if d == dtype]
            host = torch.tensor([[SLOT_PARAMS[name][1](a) for name in names] for a in admissions], dtype=dtype,
                                pin_memory=pinned)
            dev = host.to(self.device, non_blocking=True)
            for j, name in enumerate(names):
                getattr(self, name).index_copy_(0, idx, dev[:, j])
        for state in (self.phase, self.length, self.n, self.draws, self.emitted):
            state.index_fill_(0, idx, 0)
        for s in slots:
            self.host_length[s], self.host_phase[s], self.host_n[s], self.host_emitted[s] = 0, IDLE, 0, 0

    def device_index(self, slots: list[int]) -> torch.Tensor:
        pinned = self.device.type == "cuda"
        return torch.tensor(slots, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
