"""Per-slot state of one rank's runner (SPEC.md 1): every request's decoding parameters and decoding
state, in slot-indexed device buffers.

The device state is the truth. Phases, lengths, step counters, canvases and reveal-time scores change
inside a multi-step command without the host reading them (the step kinds in model/steps update them
with device ops only); the runner copies what the host needs once per command. The host keeps only
what it admitted (`SlotInfo`) and the last copied lengths, phases, denoising steps and emitted counts
(what the scheduler's step bounds read, model/phases.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.phases import IDLE
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

    @property
    def wants_scores(self) -> bool:
        return self.params.logprobs is not None


# per-slot parameter buffers written at admission: name -> dtype
_INT_PARAMS = ("max_tokens", "steps_limit", "policy", "seed", "top_k")
_FLOAT_PARAMS = ("temperature", "top_p", "tau", "gamma")
_BOOL_PARAMS = ("ignore_eos", "early_stop", "seed_first")


class SlotTable:
    def __init__(self, num_slots: int, canvas_length: int, fill_token: int, device: torch.device):
        S, C, dev = num_slots, canvas_length, device
        self.num_slots, self.C, self.device = S, C, dev
        zeros = lambda dtype=torch.int64: torch.zeros(S, dtype=dtype, device=dev)  # noqa: E731
        # decoding state
        self.phase, self.length, self.n, self.draws, self.emitted = (zeros() for _ in range(5))
        self.last_token = zeros()          # AR: the token fed next; linear speculation: the next seed
        self.canvas = torch.full((S, C), fill_token, dtype=torch.int64, device=dev)
        self.canvas_scores = ScoreBuffer(S, C, dev)   # reveal-time scores of the canvas being denoised
        self.seed_scores = ScoreBuffer(S, 1, dev)     # linear speculation: the score of the next seed
        # parameters
        for name in _INT_PARAMS:
            setattr(self, name, zeros())
        for name in _FLOAT_PARAMS:
            setattr(self, name, zeros(torch.float32))
        for name in _BOOL_PARAMS:
            setattr(self, name, zeros(torch.bool))
        self.info: dict[int, SlotInfo] = {}
        # the host's copy of the device state, as of the end of the last command
        self.host_length = [0] * S
        self.host_phase = [IDLE] * S
        self.host_n = [0] * S
        self.host_emitted = [0] * S

    def admit(self, slots: list[int], params: list[DecodeParams], seeds: list[int], steps_limit: list[int],
              gamma: list[float]) -> None:
        """Writes the parameters of newly admitted slots: one host-to-device copy per dtype, no sync."""
        pinned = self.device.type == "cuda"
        ints = torch.tensor([[p.max_tokens, n, POLICY_IDS[p.policy], seed, p.top_k]
                             for p, n, seed in zip(params, steps_limit, seeds)], dtype=torch.int64,
                            pin_memory=pinned)
        floats = torch.tensor([[p.effective_temperature, p.top_p, p.threshold, g] for p, g in zip(params, gamma)],
                              dtype=torch.float32, pin_memory=pinned)
        bools = torch.tensor([[p.ignore_eos, p.eos_early_stop and not p.ignore_eos, p.seed_first_position]
                              for p in params], dtype=torch.bool, pin_memory=pinned)
        idx = torch.tensor(slots, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        for names, host in ((_INT_PARAMS, ints), (_FLOAT_PARAMS, floats), (_BOOL_PARAMS, bools)):
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
