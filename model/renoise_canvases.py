"""The runner's DiffusionGemma part: per-slot state of uniform-noise canvases with self-conditioning
(SPEC.md 4), and the two things a slot does with it — start a canvas, take a denoise step.

A canvas starts as uniform random tokens with no self-conditioning signal; each denoise step runs
model.sampling.renoise over the step's logits, keeps the accepted samples and renoises the rest,
feeds `softmax(logits / T) @ W * sqrt(H)` to the next step, and on convergence puts the argmax canvas
in place for the commit, with its scores taken from that step's distribution. The draw counter
advances once per canvas start and once per step, on every rank alike.
"""
from __future__ import annotations

import torch

from model.config import RenoiseDefaults
from model.sampling import renoise as RN
from model.sampling.logprobs import token_scores


class RenoiseCanvases:
    def __init__(self, runner, defaults: RenoiseDefaults, hidden_size: int, dtype: torch.dtype):
        S, C, dev = runner.num_slots, runner.C, runner.device
        self.runner, self.defaults, self.dtype = runner, defaults, dtype
        self.prev_argmax = torch.full((S, C), -1, dtype=torch.int64, device=dev)
        self.run = torch.zeros(S, dtype=torch.int64, device=dev)
        self.soft = torch.zeros(S, C, hidden_size, dtype=dtype, device=dev)   # next step's self-conditioning
        self.t_min = torch.zeros(S, device=dev)
        self.t_max = torch.ones(S, device=dev)
        self.stability = torch.zeros(S, dtype=torch.int64, device=dev)
        self.confidence = torch.zeros(S, device=dev)

    def admit(self, slot: int, params) -> int:
        """Sets the slot's knobs (request values over generation_config.json); returns its N."""
        d = self.defaults
        pick = lambda value, default: default if value is None else value  # noqa: E731
        self.t_min[slot], self.t_max[slot] = pick(params.t_min, d.t_min), pick(params.t_max, d.t_max)
        if self.t_max[slot] <= self.t_min[slot]:
            raise ValueError(f"t_max must be > t_min (got {float(self.t_max[slot])} <= {float(self.t_min[slot])})")
        self.stability[slot] = pick(params.stability_threshold, d.stability_threshold)
        self.confidence[slot] = pick(params.confidence_threshold, d.confidence_threshold)
        self.runner.gamma[slot] = pick(params.entropy_bound, d.entropy_bound)
        return pick(params.max_denoising_steps, d.max_denoising_steps)

    def start(self, slots: list[int]) -> None:
        r = self.runner
        idx = r._rows(slots)
        states = [r.slots[s] for s in slots]
        counter = r._dev([st.draws for st in states])
        r.canvas[idx] = RN.random_tokens(r.seed[idx], counter, r.C, r.model.config.vocab_size)
        self.prev_argmax[idx] = -1
        self.run[idx] = 0
        self.soft[idx] = 0
        for st in states:
            st.draws += 1
            st.phase, st.n = "denoise", 0

    def denoise(self, slots: list[int], hidden: torch.Tensor, reads, counters) -> None:
        r = self.runner
        idx = r._rows(slots)
        states = [r.slots[s] for s in slots]
        step = RN.renoise_step(
            r.model.compute_logits(hidden), n=r._dev([st.n for st in states]), steps=r.steps_limit[idx],
            t_min=self.t_min[idx], t_max=self.t_max[idx], entropy_bound=r.gamma[idx],
            stability_threshold=self.stability[idx], confidence_threshold=self.confidence[idx],
            seed=r.seed[idx], counter=r._dev([st.draws for st in states]), prev_argmax=self.prev_argmax[idx],
            run=self.run[idx], vocab_start=r.model.vocab_start, vocab_size=r.model.config.vocab_size, tp=r.tp,
            soft_dtype=self.dtype, **r._filter_args(slots, idx))
        converged = step.converged
        # the commit feeds and emits the argmax canvas (SPEC.md 4.8)
        r.canvas[idx] = torch.where(converged[:, None], step.argmax, step.canvas)
        self.prev_argmax[idx] = step.argmax
        self.run[idx] = step.run
        self.soft[idx] = r.model.soft_embedding(step.probs).to(self.dtype)
        scores = r._scores(slots, step.scaled, step.argmax)
        if scores is not None:  # the converged step's distribution scores the committed tokens
            rows, (lp, rank, tv, ti) = scores
            pick = r._dev(rows)
            where = converged[pick][:, None].expand(-1, r.C)
            r.canvas_scores.write(idx[pick], where, lp, rank, tv, ti)
        counters.denoising_steps += len(slots)
        counters.canvas_positions += len(slots) * r.C
        for st in states:
            st.draws += 1
            st.n += 1

        def apply(flags, _blocks):
            for st, done in zip(states, flags):
                if done:
                    st.phase = "commit"
        reads.append((converged, apply))
