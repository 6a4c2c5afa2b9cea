"""A slot's phase (what its next step does) and a bound on the steps it can still take.

A command runs the same number of steps for every slot without the host looking in between, so a slot
that finishes early idles through the rest and its response waits for them. The scheduler therefore
sizes each command by an upper bound on the steps its slots still need, from what the host knows: the
request's parameters, and each slot's phase, denoising step and emitted count after every command. The
bound is exact when a canvas runs all its steps; an early convergence, an EOS or a stop id end a slot
sooner. Torch-free: the scheduler (workers/scheduler.py) imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.sampling.params import DecodeParams

IDLE, DENOISE, COMMIT, DRAFT, VERIFY, AR, DONE = range(7)


@dataclass(frozen=True)
class StepBudget:
    """canvas_length: C; default_canvas_steps: the family's denoising steps per canvas when a request
    sets none (DiffusionGemma's generation_config); None for masked diffusion, whose default is C.
    The bound counts a commit step after every canvas but the request's last, which is emitted when it
    converges (its commit's forward would write KV nothing reads), unless `last_canvas_commits` and the
    request is constrained (masked diffusion checks a converged canvas against the grammar at its commit)."""

    canvas_length: int
    default_canvas_steps: int | None = None
    last_canvas_commits: bool = True

    def canvas_steps(self, p: DecodeParams) -> int:
        """N: the most denoising steps one canvas takes (the runner's per-slot steps_limit)."""
        if self.default_canvas_steps is not None:
            return p.max_denoising_steps or self.default_canvas_steps
        return p.steps_for(self.canvas_length)

    def at_admission(self, p: DecodeParams) -> int:
        """Steps from the command that admits the request (its prefill runs before them) until it is done."""
        if p.mode == "ar":   # the prefill's prediction is the first token; each step adds one
            return p.max_tokens - 1
        phase = DENOISE if p.mode == "diffusion" else DRAFT
        return self.left(p, phase, n=0, emitted=0)

    def left(self, p: DecodeParams, phase: int, n: int, emitted: int) -> int:
        """Steps a slot in `phase` (n: denoising steps into its canvas; `emitted` tokens so far) can still
        run before it is done: a canvas takes at most N denoising steps and a commit, a draft and its
        verify emit at least one token, an AR step one."""
        remaining = max(p.max_tokens - emitted, 0)
        if phase == DONE or remaining == 0:
            return 0
        if phase == AR:
            return remaining
        if phase in (DRAFT, VERIFY):
            return 2 * remaining - (phase == VERIFY)
        N, C = self.canvas_steps(p), self.canvas_length
        later = -(-remaining // C) - 1            # canvases after the one in progress
        current = 1 if phase == COMMIT else max(N - n, 1) + 1
        steps = current + later * (N + 1)
        skips = not (self.last_canvas_commits and p.grammar is not None)
        last_commit_skipped = skips and (later > 0 or phase != COMMIT)
        return steps - last_commit_skipped
