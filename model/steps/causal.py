"""Next-token steps (docs/spec.md 1, 5): the prefill of newly admitted slots and AR rows, and what every
causal pass's last prediction starts — the seed of a masked canvas (the family's canvas step starts it),
the first draft's seed of linear speculation, or an emitted AR token.

The runner chooses a prefill's width (padded to a CUDA graph's, model/graphs.py) and its rows; the
steps here are device ops only, like canvas steps.
"""
from __future__ import annotations

import torch

from model.phases import AR, DONE, DRAFT
from model.steps.env import CanvasStep, StepEnv
from model.steps.plan import RowPlan


class CausalSteps:
    def __init__(self, env: StepEnv, canvas: CanvasStep):
        self.env, self.canvas = env, canvas

    def prefill(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor, tokens: torch.Tensor,
                starts: torch.Tensor, lengths: torch.Tensor, modes: torch.Tensor, fresh: bool = True) -> None:
        """Rows idx of `tokens` [B, width] (real up to `lengths`) at positions from `starts` (a cached
        prefix's end; 0 for all rows where `fresh`), modes [B, 3] (diffusion, linear_spec, ar): their KV,
        then what their last position predicts. Device ops only. A padding row (model/graphs.py), and a
        chunk short of its prompt's end, has no mode: no state of its slot changes but its length."""
        env, t = self.env, self.env.slots
        causal = torch.ones_like(idx, dtype=torch.bool)
        width = tokens.shape[1]
        hidden = env.forward(idx, tokens, starts, width, causal, width if fresh else plan.kv_len, lengths=lengths,
                             fresh=fresh)
        t.length[idx] = starts + lengths
        real = modes.any(-1)
        env.outputs.add_counters(forwards=real.long().sum(), passes=1)
        if not self.canvas.needs_prediction:   # a uniform-noise canvas needs no prediction from the prefix
            self.canvas.start(idx, real, None)
            return
        last = hidden[torch.arange(len(idx), device=env.device), lengths - 1]
        x = env.logits(last[:, None], idx)
        st = env.sampler.stats(x, idx, plan)
        scores = env.sampler.scores(x, st, st.x_sample[scored], scored, plan.top_logprobs, idx) if plan.scored else None
        env.observe("before", "prefill", idx, x)
        self.after_causal(idx, st.sample[:, 0], scores, scored, modes[:, 0], modes[:, 1], modes[:, 2])
        t.draws[idx] += real.long()   # a chunk short of its prompt's end draws nothing: its draws wait for the last
        env.observe("after", "prefill", idx)

    def after_causal(self, idx, token, scores, scored, is_diffusion, is_spec, is_ar) -> None:
        """A causal pass ended at each row's length; its prediction `token` [B] (with `scores` [B', 1] of
        rows `scored`) seeds a canvas, a draft or is an AR token."""
        env, t, C = self.env, self.env.slots, self.env.C
        self.canvas.start(idx, is_diffusion, token)
        t.last_token[idx] = torch.where(is_spec | is_ar, token, t.last_token[idx])
        count = is_ar.long()
        env.outputs.emit(idx, token[:, None], count, torch.zeros_like(count), torch.zeros_like(count), scores, scored)
        emitted = t.emitted[idx] + count
        stop = is_ar & ((emitted >= t.max_tokens[idx]) | (torch.isin(token, env.eos) & ~t.ignore_eos[idx]))
        t.emitted[idx] = emitted
        phase = t.phase[idx]
        t.phase[idx] = torch.where(is_spec, DRAFT, torch.where(is_ar, torch.where(stop, DONE, AR), phase))
        if scores is not None:
            sl = idx[scored]
            position0 = torch.zeros(len(sl), C, dtype=torch.bool, device=env.device)
            position0[:, 0] = (is_diffusion & t.seed_first[idx])[scored]
            t.canvas_scores.write(sl, position0, scores.expand(C))
            t.seed_scores.write(sl, is_spec[scored][:, None], scores)
        env.outputs.add_counters(committed_tokens=count.sum())

    def ar_step(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor) -> None:
        """One token for every AR row (docs/spec.md 5): feed the last token, sample the next at the row's temperature."""
        env, t = self.env, self.env.slots
        phase = t.phase[idx]
        live = phase == AR
        causal = torch.ones_like(live)
        hidden = env.forward(idx, t.last_token[idx][:, None], t.length[idx], 1, causal, plan.kv_len)
        x = env.logits(hidden, idx)
        st = env.sampler.stats(x, idx, plan)
        token = st.sample[:, 0]
        scores = env.sampler.scores(x, st, st.x_sample[scored], scored, plan.top_logprobs, idx) if plan.scored else None
        env.observe("before", "ar", idx, x)
        count = live.long()
        env.outputs.emit(idx, token[:, None], count, torch.zeros_like(count), torch.zeros_like(count), scores, scored)
        emitted = t.emitted[idx] + count
        stop = (emitted >= t.max_tokens[idx]) | (torch.isin(token, env.eos) & ~t.ignore_eos[idx])
        t.phase[idx] = torch.where(live & stop, DONE, phase)
        t.length[idx] += count
        t.emitted[idx] = emitted
        t.last_token[idx] = torch.where(live, token, t.last_token[idx])
        t.draws[idx] += count
        env.outputs.add_counters(committed_tokens=count.sum(), forwards=count.sum(), passes=1)
        env.observe("after", "ar", idx)
