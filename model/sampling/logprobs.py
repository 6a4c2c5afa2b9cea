"""Reveal-time scores (SPEC.md section 6): for a token and the distribution it was revealed or sampled
from (`scaled` = filtered logits / T, vocabulary-sharded), its logprob, its rank and the top-k
alternatives. Written once, at reveal, into slot-indexed buffers; never rewritten by later steps."""
from __future__ import annotations

import torch

from model.parallel import reductions as R
from model.parallel.group import TPGroup
from model.sampling.params import MAX_LOGPROBS


def token_scores(scaled: torch.Tensor, tokens: torch.Tensor, top_k: int, vocab_start: int, tp: TPGroup):
    """scaled [R, P, Vr], tokens [R, P] -> logprob [R, P], rank [R, P], top values/ids [R, P, top_k]."""
    lse = R.logsumexp(scaled, tp)
    chosen = R.value_at(scaled, tokens, vocab_start, tp)
    rank = 1 + R.count_greater(scaled, chosen, tp)
    top_values = top_ids = None
    if top_k:
        top_values, top_ids = R.topk(scaled, top_k, vocab_start, tp)
        top_values = top_values - lse.unsqueeze(-1)
    return chosen - lse, rank, top_values, top_ids


class ScoreBuffer:
    """Per slot and position: logprob, rank and up to MAX_LOGPROBS alternatives."""

    def __init__(self, num_slots: int, width: int, device):
        self.logprob = torch.zeros(num_slots, width, device=device)
        self.rank = torch.zeros(num_slots, width, dtype=torch.int64, device=device)
        self.top_values = torch.full((num_slots, width, MAX_LOGPROBS), -torch.inf, device=device)
        self.top_ids = torch.zeros(num_slots, width, MAX_LOGPROBS, dtype=torch.int64, device=device)

    def write(self, slots: torch.Tensor, where: torch.Tensor, logprob, rank, top_values, top_ids) -> None:
        """Rows `slots`, positions where `where` [R, P] is True (P = the buffer's width)."""
        self.logprob[slots] = torch.where(where, logprob, self.logprob[slots])
        self.rank[slots] = torch.where(where, rank, self.rank[slots])
        if top_values is not None:
            k = top_values.shape[-1]
            w = where.unsqueeze(-1)
            self.top_values[slots, :, :k] = torch.where(w, top_values, self.top_values[slots, :, :k])
            self.top_ids[slots, :, :k] = torch.where(w, top_ids, self.top_ids[slots, :, :k])

    def write_at(self, slots: torch.Tensor, index: torch.Tensor, logprob, rank, top_values, top_ids) -> None:
        """One position per row: index [R]; scores [R] (top [R, k])."""
        self.logprob[slots, index] = logprob
        self.rank[slots, index] = rank
        if top_values is not None:
            k = top_values.shape[-1]
            self.top_values[slots, index, :k] = top_values
            self.top_ids[slots, index, :k] = top_ids

    def copy_position(self, slots: torch.Tensor, dst: int, src: "ScoreBuffer", src_pos: int) -> None:
        for name in ("logprob", "rank", "top_values", "top_ids"):
            getattr(self, name)[slots, dst] = getattr(src, name)[slots, src_pos]

    def copy_rows(self, dst_slots: torch.Tensor, src: "ScoreBuffer", src_slots: torch.Tensor) -> None:
        for name in ("logprob", "rank", "top_values", "top_ids"):
            getattr(self, name)[dst_slots] = getattr(src, name)[src_slots]
