"""Provisional canvases for the slots that asked (`DecodeParams.stream_drafts`): snapshots of a canvas
being denoised, taken on the device every `draft_every` denoising steps (a device-side condition) and
copied to the host with the command's one copy.

A snapshot is the canvas's tokens with a `known` flag per position: masked diffusion's canvas (mask
token where masked) and its revealed positions; DiffusionGemma's argmax canvas and the positions the
entropy bound accepted. Snapshots read the canvas and write nothing else, so committed tokens and scores
do not depend on them (docs/spec.md section 10).
"""
from __future__ import annotations

import torch

from model.protocol import Draft


class DraftBuffer:
    def __init__(self, num_slots: int, canvas_length: int, max_steps: int, device: torch.device):
        S, C, dev = num_slots + 1, canvas_length, device   # + the slot table's padding row
        self.device, self.max_drafts = dev, max_steps    # at most one snapshot per step
        D = max_steps + 1                                 # the last row takes the writes of rows not due
        self.every = torch.zeros(S, dtype=torch.int64, device=dev)   # draft_every; 0: the slot does not draft
        self.tokens = torch.zeros(S, D, C, dtype=torch.int64, device=dev)
        self.known = torch.zeros(S, D, C, dtype=torch.bool, device=dev)
        self.start = torch.zeros(S, D, dtype=torch.int64, device=dev)    # the canvas's first absolute position
        self.step = torch.zeros(S, D, dtype=torch.int64, device=dev)     # denoising steps of the canvas so far
        self.count = torch.zeros(S, dtype=torch.int64, device=dev)       # the cursor: snapshots this command

    def admit(self, slots: list[int], every: list[int]) -> None:
        pinned = self.device.type == "cuda"
        idx = torch.tensor(slots, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        values = torch.tensor(every, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        self.every.index_copy_(0, idx, values)

    def reset(self) -> None:
        self.count.zero_()

    def record(self, idx: torch.Tensor, tokens: torch.Tensor, known: torch.Tensor, step: torch.Tensor,
               denoised: torch.Tensor, start: torch.Tensor) -> None:
        """After a canvas-wide step of rows idx [B]: tokens/known [B, C] the canvas as a draft shows it,
        step [B] its denoising steps so far, denoised [B] rows whose step was a denoise, start [B] the
        canvas's first position. Drafting rows snapshot where step is a multiple of their draft_every."""
        every = self.every[idx]
        due = denoised & (every > 0) & (step % every.clamp(min=1) == 0)
        dest = torch.where(due, self.count[idx], self.max_drafts).clamp(max=self.max_drafts)
        self.tokens.index_put_((idx, dest), tokens)
        self.known.index_put_((idx, dest), known)
        self.start.index_put_((idx, dest), start)
        self.step.index_put_((idx, dest), step)
        self.count.index_add_(0, idx, due.long())

    def parts(self, slots: list[int], steps: int) -> dict[str, torch.Tensor]:
        """What copy_out copies for the drafting `slots` of a command of `steps` steps."""
        pinned = self.device.type == "cuda"
        idx = torch.tensor(slots, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        n = min(steps, self.max_drafts)
        return {"draft_count": self.count[idx], "draft_tokens": self.tokens[idx, :n],
                "draft_known": self.known[idx, :n], "draft_start": self.start[idx, :n],
                "draft_step": self.step[idx, :n]}

    @staticmethod
    def drafts(host: dict[str, torch.Tensor], slots: list[int]) -> dict[int, list[Draft]]:
        """The host copies of `parts` -> each slot's drafts of the command, in order (slots without any
        left out)."""
        count, start, step, tokens, known = (host[f"draft_{name}"].tolist()
                                             for name in ("count", "start", "step", "tokens", "known"))
        return {s: [Draft(start[i][j], step[i][j], tokens[i][j], known[i][j]) for j in range(count[i])]
                for i, s in enumerate(slots) if count[i]}
