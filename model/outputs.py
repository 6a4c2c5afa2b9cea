"""What a command's slots emit, gathered on the device and copied to the host once per command.

Each slot has a token stream for the command: a step that emits (a commit, an accepted draft, an AR
token) appends to it at the slot's cursor, with the scores of each token, and adds to the slot's
canvas and denoising-step totals. Device ops only, so steps can append inside CUDA graphs; the
stream's capacity bounds what a command of `max_steps` steps can emit. `copy_out` moves cursors,
streams, counters and the slots' lengths, phases, step counters and emitted counts to the host in one
synchronisation.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from model.drafts import DraftBuffer
from model.protocol import Block, StepCounters
from model.sampling.params import MAX_LOGPROBS
from model.slots import Scores, SlotTable

COUNTERS = tuple(f.name for f in fields(StepCounters))   # the order of CommandOutputs.counters' entries


class CommandOutputs:
    def __init__(self, num_slots: int, canvas_length: int, max_steps: int, device: torch.device):
        S, dev = num_slots + 1, device   # + the slot table's padding row (model/slots.py)
        # a canvas (or a verified draft) is emitted at most every other step, an AR token every step
        self.capacity = max(-(-max_steps // 2) * canvas_length, max_steps + 1) + canvas_length
        self.max_steps = max_steps
        cap = self.capacity + 1   # the last column takes writes of positions past a row's count
        self.tokens = torch.zeros(S, cap, dtype=torch.int64, device=dev)
        self.logprob = torch.zeros(S, cap, device=dev)
        self.rank = torch.zeros(S, cap, dtype=torch.int64, device=dev)
        self.top_values = torch.zeros(S, cap, MAX_LOGPROBS, device=dev)
        self.top_ids = torch.zeros(S, cap, MAX_LOGPROBS, dtype=torch.int64, device=dev)
        self.count = torch.zeros(S, dtype=torch.int64, device=dev)       # the cursor: tokens emitted
        self.canvases = torch.zeros(S, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(S, dtype=torch.int64, device=dev)       # denoising steps of those canvases
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=dev)
        self.device = dev

    def reset(self) -> None:
        for t in (self.count, self.canvases, self.steps, self.counters):
            t.zero_()

    def emit(self, idx: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor, canvases: torch.Tensor,
             steps: torch.Tensor, scores: Scores | None = None, scored: torch.Tensor | None = None) -> None:
        """Rows idx [B] append tokens[:, :count] ([B, W]; count [B], 0 for rows that emit nothing);
        `scores` [B', W] belong to rows `scored` (indices into idx)."""
        width = tokens.shape[1]
        j = torch.arange(width, device=tokens.device)
        dest = torch.where(j[None, :] < count[:, None], self.count[idx][:, None] + j[None, :], self.capacity)
        dest = dest.clamp(max=self.capacity)
        rows = idx[:, None].expand(-1, width)
        self.tokens.index_put_((rows, dest), tokens)
        if scores is not None and scored is not None and scored.numel():
            r, d = rows[scored], dest[scored]
            self.logprob.index_put_((r, d), scores.logprob)
            self.rank.index_put_((r, d), scores.rank)
            if scores.top_values is not None:
                k = scores.top_values.shape[-1]
                self.top_values[:, :, :k].index_put_((r, d), scores.top_values)
                self.top_ids[:, :, :k].index_put_((r, d), scores.top_ids)
        self.count.index_add_(0, idx, count)
        self.canvases.index_add_(0, idx, canvases)
        self.steps.index_add_(0, idx, steps)

    def add_counters(self, **values) -> None:
        """This step's contribution to the command's counters (COUNTERS' names), each a device scalar or
        a python int (made on the device by a fill, never copied from the host: a graph can capture it)."""
        unknown = set(values) - set(COUNTERS)
        assert not unknown, unknown
        zero = self.counters.new_zeros(())
        self.counters += torch.stack([zero + values.get(name, 0) for name in COUNTERS])

    def copy_out(self, slots: SlotTable, emitting: list[int], scored: dict[int, int], drafts: DraftBuffer | None = None,
                 drafting: list[int] = (), command_steps: int = 0) -> tuple[list[Block], StepCounters]:
        """The host's copy of the command's results (one synchronisation): a Block per slot in `emitting`
        that emitted, committed or drafted anything; `scored` maps the slots that asked for scores to their
        k; `drafting` the slots whose drafts of this command (of `command_steps` steps) ride along.
        Also refreshes the table's host copy of lengths, phases, denoising steps and emitted counts."""
        dev = self.device
        small = torch.stack([self.count, self.canvases, self.steps, slots.length, slots.phase, slots.n, slots.emitted])
        parts = {"small": small, "counters": self.counters, "tokens": self.tokens[:, : self.capacity]}
        kmax = max(scored.values(), default=0)
        if scored:
            idx = slots.device_index(sorted(scored))
            parts |= {"logprob": self.logprob[idx, : self.capacity], "rank": self.rank[idx, : self.capacity]}
            if kmax:
                parts |= {"top_values": self.top_values[idx, : self.capacity, :kmax],
                          "top_ids": self.top_ids[idx, : self.capacity, :kmax]}
        if drafting:
            parts |= drafts.parts(drafting, command_steps)
        if dev.type == "cuda":
            host = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in parts.items()}
            for name, t in parts.items():
                host[name].copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()   # the command's one wait (an event: sync-debug mode does not flag it)
        else:
            host = {name: t.clone() for name, t in parts.items()}
        count, canvases, steps, length, phase, n, emitted = host["small"].tolist()
        slots.host_length, slots.host_phase, slots.host_n, slots.host_emitted = length, phase, n, emitted
        counters = StepCounters(**dict(zip(COUNTERS, host["counters"].tolist())))
        row_of = {s: i for i, s in enumerate(sorted(scored))}
        drafted = DraftBuffer.drafts(host, drafting) if drafting else {}
        blocks = []
        for s in emitting:
            n = count[s]
            if not n and not canvases[s] and s not in drafted:
                continue
            block = Block(slot=s, tokens=host["tokens"][s, :n].tolist(), denoising_steps=steps[s],
                          canvases=canvases[s], drafts=drafted.get(s), length=length[s])
            if s in row_of and n:
                i, k = row_of[s], scored[s]
                block.logprobs = host["logprob"][i, :n].tolist()
                block.ranks = host["rank"][i, :n].tolist()
                block.top_ids = host["top_ids"][i, :n, :k].tolist() if k else [[] for _ in range(n)]
                block.top_logprobs = host["top_values"][i, :n, :k].tolist() if k else [[] for _ in range(n)]
            blocks.append(block)
        return blocks, counters
