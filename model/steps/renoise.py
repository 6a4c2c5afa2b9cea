"""Canvas-wide rows of uniform-noise diffusion with self-conditioning (docs/spec.md 4, DiffusionGemma), and
the per-slot state only that family has: the previous argmax canvas and stability run, the next step's
self-conditioning signal, and each request's schedule knobs.

One forward over every row (causal for commit rows), device ops only. A denoise step runs the renoise
sampler and computes the next signal; on convergence the argmax canvas is put in place, scored by that
step's distribution. A converged canvas that ends the request is emitted at once (its commit's forward
would only write KV nothing reads); otherwise its commit emits it and starts the next canvas.
"""
from __future__ import annotations

import torch

from model.config import RenoiseDefaults
from model.phases import COMMIT, DENOISE, DONE
from model.sampling import renoise as RN
from model.sampling.params import DecodeParams
from model.sampling.stats import value_at
from model.slots import Scores
from model.steps.compiled import CompiledUpdate, compile_updates_enabled
from model.steps.env import StepEnv
from model.steps.masked import contains_eos
from model.steps.plan import RowPlan


class RenoiseCanvasStep:
    needs_prediction = False   # a canvas starts as uniform noise: its prefill computes no logits

    def __init__(self, env: StepEnv, defaults: RenoiseDefaults):
        S, C, dev = env.slots.num_slots + 1, env.C, env.device   # + the padding row
        hidden_size, dtype = env.model.config.hidden_size, env.dtype
        self.env, self.defaults = env, defaults
        # transformers rounds the self-conditioning logits to the embedding dtype
        self.soft_dtype = None if dtype == torch.float32 else dtype
        self.prev_argmax = torch.full((S, C), -1, dtype=torch.int64, device=dev)
        self.run = torch.zeros(S, dtype=torch.int64, device=dev)
        self.soft = torch.zeros(S, C, hidden_size, dtype=dtype, device=dev)   # next step's self-conditioning
        self.t_min = torch.zeros(S, device=dev)
        self.t_max = torch.ones(S, device=dev)
        self.stability = torch.zeros(S, dtype=torch.int64, device=dev)
        self.confidence = torch.zeros(S, device=dev)
        self.self_conditioning = True   # False only to measure what it costs (benchmarks)
        self.update = CompiledUpdate(self._update, compile_updates_enabled(dev))

    def knobs(self, params: DecodeParams) -> dict:
        """The request's schedule knobs over generation_config.json's, the schedule's ends scaled by the
        request's temperature (DecodeParams.schedule_scale); ValueError naming a bad one."""
        d = self.defaults
        pick = lambda value, default: default if value is None else value  # noqa: E731
        scale = params.schedule_scale
        knobs = dict(t_min=scale * pick(params.t_min, d.t_min), t_max=scale * pick(params.t_max, d.t_max),
                     stability=pick(params.stability_threshold, d.stability_threshold),
                     confidence=pick(params.confidence_threshold, d.confidence_threshold),
                     gamma=pick(params.entropy_bound, d.entropy_bound))
        if knobs["t_max"] <= knobs["t_min"]:
            raise ValueError(f"t_max must be > t_min (got {knobs['t_max']} <= {knobs['t_min']})")
        return knobs

    def admit(self, slots: list[int], knobs: list[dict]) -> None:
        env = self.env
        idx = env.slots.device_index(slots)
        for name in ("t_min", "t_max", "stability", "confidence"):
            buf = getattr(self, name)
            values = torch.tensor([k[name] for k in knobs], dtype=buf.dtype, pin_memory=env.device.type == "cuda")
            buf.index_copy_(0, idx, values.to(env.device, non_blocking=True))

    def start(self, idx: torch.Tensor, where: torch.Tensor, prediction: None = None) -> None:
        """Rows idx where `where`: a new canvas of uniform random tokens (one draw), denoised next."""
        t, C = self.env.slots, self.env.C
        fresh = RN.random_tokens(t.seed[idx], t.draws[idx], C, self.env.model.config.vocab_size)
        w = where[:, None]
        t.canvas[idx] = torch.where(w, fresh, t.canvas[idx])
        self.prev_argmax[idx] = torch.where(w, -1, self.prev_argmax[idx])
        self.run[idx] = torch.where(where, 0, self.run[idx])
        self.soft[idx] = torch.where(w[..., None], 0, self.soft[idx])
        t.n[idx] = torch.where(where, 0, t.n[idx])
        t.phase[idx] = torch.where(where, DENOISE, t.phase[idx])
        t.draws[idx] += where.long()

    def __call__(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor) -> None:
        r, t, C = self.env, self.env.slots, self.env.C
        length, canvas, n = t.length[idx], t.canvas[idx], t.n[idx]
        hidden = r.forward(idx, canvas, length, C, t.phase[idx] == COMMIT, plan.kv_len, soft=self.soft[idx])
        x = r.logits(hidden, idx)   # a constrained row's frontier: its grammar's tokens only
        threshold = r.sampler.threshold(x, idx, plan) if plan.filters else None
        step = RN.renoise_step(
            x, n=n, steps=t.steps_limit[idx], t_min=self.t_min[idx], t_max=self.t_max[idx],
            entropy_bound=t.gamma[idx], stability_threshold=self.stability[idx],
            confidence_threshold=self.confidence[idx], seed=t.seed[idx], counter=t.draws[idx],
            prev_argmax=self.prev_argmax[idx], run=self.run[idx], vocab_start=r.model.vocab_start,
            vocab_size=r.model.config.vocab_size, tp=r.tp, threshold=threshold, soft_dtype=self.soft_dtype,
            softcap=r.model.logit_softcap, passes=r.sampler.passes, probs_dtype=self.soft.dtype)
        r.observe("before", "canvas", idx, x)
        scores = None
        if plan.scored:   # the converged step's distribution scores the committed argmax tokens (docs/spec.md 6):
            # only a row converging now keeps its scores, so only those read the vocabulary for them
            fixed = t.grammar_fixed[idx]   # a pinned position emits its pin (docs/spec.md 12): scored as that
            x_tok = value_at(x[scored], torch.where(fixed >= 0, fixed, step.argmax)[scored], r.model.vocab_start, r.tp)
            scores = r.sampler.scores(x, step.stats, x_tok, scored, plan.top_logprobs, idx,
                                      needed=step.converged[scored])
        soft = r.model.soft_embedding(step.probs) if self.self_conditioning else None
        self.update(plan, idx, scored, step, scores, soft)
        r.observe("after", "canvas", idx)

    def _grammar(self, idx: torch.Tensor, step: RN.RenoiseStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A constrained row's argmax and next canvas with its pinned tokens, and whether it may converge: only
        once the host found its argmax canvas a whole valid text, and this step kept that canvas where valid
        (docs/spec.md 12). An unconstrained row's are the sampler's."""
        t, C = self.env.slots, self.env.C
        fixed = t.grammar_fixed[idx]
        pinned = fixed >= 0
        argmax = torch.where(pinned, fixed, step.argmax)
        sampled = torch.where(pinned, fixed, step.canvas)
        valid = t.grammar_valid[idx]
        checked = torch.arange(C, device=idx.device) < valid[:, None]
        kept = ((argmax == self.prev_argmax[idx]) | ~checked).all(-1)
        may = (valid < 0) | (t.grammar_done[idx] & kept)
        return argmax, sampled, step.converged & may

    def _update(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor, step: RN.RenoiseStep,
                scores: Scores | None, soft: torch.Tensor | None) -> None:
        """The renoise sampler's decisions kept where the row is in that phase; commit rows, and denoise
        rows whose canvas converged and ends the request, emit."""
        r, t, C = self.env, self.env.slots, self.env.C
        phase, length, canvas, n = t.phase[idx], t.length[idx], t.canvas[idx], t.n[idx]
        is_denoise, is_commit = phase == DENOISE, phase == COMMIT
        live = phase != DONE
        argmax, sampled, converged = self._grammar(idx, step)
        converged = converged & is_denoise
        if scores is not None:
            t.canvas_scores.write(idx[scored], converged[scored][:, None].expand(-1, C), scores)
        # a converged canvas that ends the request emits now (it skips its commit); commit rows emit
        # the canvas their last denoise step put in place
        max_tokens, stops_at_eos = t.max_tokens[idx], ~t.ignore_eos[idx]
        whole = torch.full_like(n, C)
        ends = (t.emitted[idx] + C >= max_tokens) | (contains_eos(argmax, whole, r.eos) & stops_at_eos)
        final = converged & ends
        emitting = is_commit | final
        out = torch.where(final[:, None], argmax, canvas)
        count = torch.where(emitting, C, 0)
        emitted = t.emitted[idx] + count
        stop = (emitted >= max_tokens) | (contains_eos(out, count, r.eos) & stops_at_eos)
        block_scores = t.canvas_scores.read(idx[scored], scores.k) if scores is not None else None
        r.outputs.emit(idx, out, count, emitting.long(), torch.where(is_commit, n, torch.where(final, n + 1, 0)),
                       block_scores, scored)

        denoised = torch.where(converged[:, None], argmax, sampled)
        t.canvas[idx] = torch.where(is_denoise[:, None], denoised, canvas)
        self.prev_argmax[idx] = torch.where(is_denoise[:, None], argmax, self.prev_argmax[idx])
        self.run[idx] = torch.where(is_denoise, step.run, self.run[idx])
        if soft is not None:
            self.soft[idx] = torch.where(is_denoise[:, None, None], soft.to(self.soft.dtype), self.soft[idx])
        t.n[idx] = torch.where(is_denoise, n + 1, n)
        if plan.drafting:  # the argmax canvas (the sampled one is partly noise), accepted positions known
            r.drafts.record(idx, argmax, step.accepted, n + 1, is_denoise, length)
        t.phase[idx] = torch.where(converged & ~final, COMMIT, torch.where(emitting & stop, DONE, phase))
        t.length[idx] = length + torch.where(is_commit, C, 0)   # a commit's forward wrote the canvas's KV
        t.emitted[idx] = emitted
        # a denoise step draws once; a commit's draw starts the next canvas
        t.draws[idx] += is_denoise.long()
        self.start(idx, is_commit & ~stop)
        denoising = is_denoise.long().sum()
        r.outputs.add_counters(committed_tokens=count.sum(), denoising_steps=denoising,
                               canvas_positions=denoising * C, canvases=emitting.long().sum(),
                               forwards=live.long().sum(), passes=1)
