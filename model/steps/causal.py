"""Next-token steps (SPEC.md 1, 5): the prefill of newly admitted slots and AR rows, and what every
causal pass's last prediction starts — the seed of a masked canvas, the first draft's seed of linear
speculation, or an emitted AR token.

The prefill runs in a command's first step: eager at the longest new prompt's width, or on CUDA a
graph's replay at a padded width (model/graphs.py); AR steps are device ops only, like canvas steps.
"""
from __future__ import annotations

import torch

from model.graphs import PREFILL_GRAPH_TOKENS, prefill_width
from model.phases import AR, DENOISE, DONE, DRAFT
from model.steps.plan import RowPlan


class CausalSteps:
    def __init__(self, runner):
        self.r = runner

    def prefill(self, slots: list[int]) -> None:
        """The prompts of newly admitted `slots`, in one causal pass; on CUDA a graph's replay up to
        PREFILL_GRAPH_TOKENS (model/graphs.py), the prompts padded to its width."""
        r, t = self.r, self.r.slots
        infos = [t.info[s] for s in slots]
        longest = max(len(i.prompt) for i in infos)
        width = prefill_width(longest, r.kv.max_len)
        graphed = r.graphs is not None and r.observer is None and len(slots) * width <= PREFILL_GRAPH_TOKENS
        width = width if graphed else longest
        plan = r.plan(slots, width)
        pinned = r.device.type == "cuda"
        tokens = torch.zeros(len(slots), width, dtype=torch.int64, pin_memory=pinned)
        for row, info in enumerate(infos):
            tokens[row, : len(info.prompt)] = torch.tensor(info.prompt)
        host = (torch.tensor(slots, dtype=torch.int64, pin_memory=pinned),
                torch.tensor(list(plan.scored), dtype=torch.int64, pin_memory=pinned), tokens,
                torch.tensor([len(i.prompt) for i in infos], dtype=torch.int64, pin_memory=pinned),
                torch.tensor([[i.params.mode == m for m in ("diffusion", "linear_spec", "ar")] for i in infos],
                             dtype=torch.bool, pin_memory=pinned))
        step = lambda *inputs: self._prefill(plan, *inputs)   # noqa: E731
        if graphed:
            r.graphs.run(("prefill", plan), step, *r.graphs.static_inputs(("prefill", plan), *host))
        else:
            step(*(h.to(r.device, non_blocking=True) for h in host))

    def _prefill(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor, tokens: torch.Tensor,
                 lengths: torch.Tensor, modes: torch.Tensor) -> None:
        """Rows idx of `tokens` [B, width] (real up to `lengths`), modes [B, 3] (diffusion, linear_spec,
        ar): their KV, then what their last position predicts. Device ops only."""
        r, t = self.r, self.r.slots
        causal = torch.ones_like(idx, dtype=torch.bool)
        width = tokens.shape[1]
        hidden = r.forward(idx, tokens, torch.zeros_like(lengths), width, causal, width, lengths=lengths, fresh=True)
        t.length[idx] = lengths
        r.outputs.add_counters(forwards=len(idx))
        if r.renoise is not None:  # a uniform-noise canvas needs no prediction from the prefix
            r.renoise.start(idx, causal)
            return
        last = hidden[torch.arange(len(idx), device=r.device), lengths - 1]
        x = r.logits(last[:, None])
        st = r.sampler.stats(x, idx, plan)
        scores = r.sampler.scores(x, st, st.x_sample[scored], scored, plan.top_logprobs) if plan.scored else None
        r.observe("before", "prefill", idx, x)
        self.after_causal(idx, st.sample[:, 0], scores, scored, modes[:, 0], modes[:, 1], modes[:, 2])
        t.draws[idx] += 1
        r.observe("after", "prefill", idx)

    def after_causal(self, idx, token, scores, scored, is_diffusion, is_spec, is_ar) -> None:
        """A causal pass ended at each row's length; its prediction `token` [B] (with `scores` [B', 1] of
        rows `scored`) seeds a canvas, a draft or is an AR token."""
        r, t, C = self.r, self.r.slots, self.r.C
        fresh = torch.full((len(token), C), r.mask_id, dtype=torch.int64, device=r.device)
        seeded = is_diffusion & t.seed_first[idx]
        fresh[:, 0] = torch.where(seeded, token, r.mask_id)
        t.canvas[idx] = torch.where(is_diffusion[:, None], fresh, t.canvas[idx])
        t.n[idx] = torch.where(is_diffusion, 0, t.n[idx])
        t.last_token[idx] = torch.where(is_spec | is_ar, token, t.last_token[idx])
        count = is_ar.long()
        r.outputs.emit(idx, token[:, None], count, torch.zeros_like(count), torch.zeros_like(count), scores, scored)
        emitted = t.emitted[idx] + count
        stop = is_ar & ((emitted >= t.max_tokens[idx]) | (torch.isin(token, r.eos) & ~t.ignore_eos[idx]))
        t.emitted[idx] = emitted
        t.phase[idx] = torch.where(is_diffusion, DENOISE, torch.where(is_spec, DRAFT, torch.where(stop, DONE, AR)))
        if scores is not None:
            sl = idx[scored]
            position0 = torch.zeros(len(sl), C, dtype=torch.bool, device=r.device)
            position0[:, 0] = seeded[scored]
            t.canvas_scores.write(sl, position0, scores.expand(C))
            t.seed_scores.write(sl, is_spec[scored][:, None], scores)
        r.outputs.add_counters(committed_tokens=count.sum())

    def ar_step(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor) -> None:
        """One token for every AR row (SPEC.md 5): feed the last token, sample the next at the row's temperature."""
        r, t = self.r, self.r.slots
        phase = t.phase[idx]
        live = phase == AR
        causal = torch.ones_like(live)
        hidden = r.forward(idx, t.last_token[idx][:, None], t.length[idx], 1, causal, plan.kv_len)
        x = r.logits(hidden)
        st = r.sampler.stats(x, idx, plan)
        token = st.sample[:, 0]
        scores = r.sampler.scores(x, st, st.x_sample[scored], scored, plan.top_logprobs) if plan.scored else None
        r.observe("before", "ar", idx, x)
        count = live.long()
        r.outputs.emit(idx, token[:, None], count, torch.zeros_like(count), torch.zeros_like(count), scores, scored)
        emitted = t.emitted[idx] + count
        stop = (emitted >= t.max_tokens[idx]) | (torch.isin(token, r.eos) & ~t.ignore_eos[idx])
        t.phase[idx] = torch.where(live & stop, DONE, phase)
        t.length[idx] += count
        t.emitted[idx] = emitted
        t.last_token[idx] = torch.where(live, token, t.last_token[idx])
        t.draws[idx] += count
        r.outputs.add_counters(committed_tokens=count.sum(), forwards=count.sum())
        r.observe("after", "ar", idx)
