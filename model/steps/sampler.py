"""The sampler every step kind shares: statistics of its rows' logits (model.sampling.stats), the
candidate filters that feed them, and reveal-time scores for the rows that asked.

Filters (docs/spec.md 3.2; DiffusionGemma: on the softcapped logits before the temperature, as transformers'
logits processors) become one threshold per position, kept iff value >= threshold (-inf for rows that
ask none); they, and scores, cost passes over the logits only in plans whose rows ask (model/steps/plan.py),
and in a CUDA graph's plan, which always has them, the kernels skip the rows that did not ask.
"""
from __future__ import annotations

import torch

from model.sampling import stats as S
from model.slots import Scores, SlotTable
from model.steps.plan import RowPlan


# how far above log 1 a logprob may round: the token's s and the normaliser are each within an ulp or
# two of |s| of the same value (a distribution of one entry: top_k 1), computed by torch and by the passes
ROUNDING_ULPS = 8


def _log_probability(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """s - lse, at most log 1 where it exceeds it by rounding alone; a larger excess is left to show
    (a wrong normaliser must not pass as a certain token)."""
    logprob = s - lse
    rounding = ROUNDING_ULPS * torch.finfo(torch.float32).eps * s.abs().clamp(min=1)
    return torch.where(logprob <= rounding, logprob.clamp(max=0), logprob)


class RowSampler:
    def __init__(self, model, slots: SlotTable, passes: S.VocabPasses = S.TORCH_PASSES):
        self.slots, self.tp = slots, model.tp
        self.vocab_start = model.vocab_start
        self.softcap = model.logit_softcap
        self.filter_on_scaled = self.softcap is None   # masked diffusion decides filters on logits / T
        self.passes = passes

    def stats(self, x: torch.Tensor, idx: torch.Tensor, plan: RowPlan) -> S.VocabStats:
        """x [B, P, V_r] raw logits of rows idx, at the rows' own temperatures."""
        t = self.slots
        threshold = self.threshold(x, idx, plan) if plan.filters else None
        return S.vocab_stats(x, t.temperature[idx], t.seed[idx], t.draws[idx], self.vocab_start, self.tp,
                             softcap=self.softcap, threshold=threshold, threshold_on_scaled=self.filter_on_scaled,
                             sampling=plan.sampling, passes=self.passes)

    def threshold(self, x: torch.Tensor, idx: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """[B, P]: the smallest kept value (in the space the filter is decided in), -inf for no filter."""
        t = self.slots
        return self.passes.threshold(x, t.temperature[idx], t.top_k[idx], t.top_p[idx], self.vocab_start, self.tp,
                                     softcap=self.softcap, on_scaled=self.filter_on_scaled)

    def scores(self, x: torch.Tensor, stats: S.VocabStats, x_tok: torch.Tensor, rows: torch.Tensor,
               k: int, idx: torch.Tensor, needed: torch.Tensor | None = None) -> Scores:
        """Scores (docs/spec.md 6) for the scored rows `rows` [B'] (of the step's rows idx) of the tokens whose raw
        logits are x_tok [B', P]: logprob under softmax(s), rank = 1 + entries with a larger logit, and the
        top k alternatives. A row whose request asked no scores (in a graph's plan, which scores every row),
        or where `needed` [B'] is False, gets none computed: its values mean nothing and nothing reads them."""
        xs = x[rows]
        temp = stats.temperature[rows].view(-1, 1)
        lse_s = stats.lse_s[rows]
        logprob = _log_probability(S.unscaled(x_tok, self.softcap) / temp, lse_s)
        asked = self.slots.logprobs[idx[rows]]
        if needed is not None:
            asked = torch.where(needed, asked, -1)
        counts, keys = self.passes.rank_top_k(xs, x_tok, k, self.vocab_start, asked=asked)
        rank = 1 + self.tp.all_reduce(counts)
        if not k:
            return Scores(logprob, rank)
        values, ids = self._merge_ranks(keys, k)
        s = S.unscaled(values, self.softcap) / temp.unsqueeze(-1)
        if stats.threshold is not None:  # filtered alternatives have no probability
            base = s if self.filter_on_scaled else S.unscaled(values, self.softcap)
            kept = base >= stats.threshold[rows].unsqueeze(-1)
            s = torch.where(kept, s, -torch.inf)
        return Scores(logprob, rank, _log_probability(s, lse_s.unsqueeze(-1)), ids)

    def _merge_ranks(self, keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rank's k largest keys [B', P, k] -> the global k largest raw logits and their ids, ties to
        the lowest id."""
        if self.tp.is_parallel:
            keys = torch.movedim(self.tp.all_gather(keys), 0, -2).flatten(-2).topk(k, dim=-1).values
        return S.decode_keys(keys)
