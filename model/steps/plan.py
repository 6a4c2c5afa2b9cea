"""What a step computes, decided on the host once per command: its rows, the keys they may read, and which
of the sampler's optional passes run. A step's code depends only on its plan (and its rows' device
state), so a plan is also the key of the step's CUDA graph.

Every request option is a per-slot device value every row reads (model/slots.py), and a pass a row did
not ask for leaves that row's results as they would be without it. So one plan serves any mix of
options: `plan_rows` (exact: the passes some row asks for; eager steps) and `graph_plan` (every pass on,
rows padded to a capture size, scores on or off: the captured graphs) give every row the same tokens and
scores (tests/test_graph_plans.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from model.sampling.params import MAX_LOGPROBS
from model.sampling.reveal import POLICIES
from model.slots import SlotInfo


@dataclass(frozen=True)
class RowPlan:
    rows: int                      # B (a graph's: its capture size, padding rows included)
    kv_len: int                    # keys a row may read during the command (a key bucket)
    scored: tuple[int, ...]        # rows (0..B-1) whose scores are computed
    top_logprobs: int              # k of the top-k alternatives computed for them (0: none)
    sampling: bool                 # Gumbel noise drawn for rows with temperature > 0 (else all greedy)
    filters: bool                  # top-k / top-p thresholds found (rows that ask neither keep every token)
    policies: tuple[str, ...]      # reveal policies computed (masked diffusion; each row keeps its own)
    early_stop: bool               # the stop at a clean EOS computed (rows that ask keep it)
    drafting: bool                 # snapshots taken (by rows whose draft_every is set)
    # rows (0..B-1) whose verify a grammar limits at every draft position (constrained linear speculation,
    # docs/spec.md 12; the runner sets them from the host's check): eager steps only, so the graphs mask
    # one position a row
    spans: tuple[int, ...] = ()


def plan_rows(infos: list[SlotInfo], kv_len: int, uniform_noise: bool) -> RowPlan:
    """The exact plan of these rows: only the passes some row asks for."""
    params = [i.params for i in infos]
    scored = tuple(r for r, i in enumerate(infos) if i.wants_scores)
    return RowPlan(
        rows=len(infos), kv_len=kv_len, scored=scored,
        top_logprobs=max((params[r].logprobs for r in scored), default=0),
        # uniform noise always samples (its temperature comes from the schedule)
        sampling=uniform_noise or any(p.effective_temperature > 0 for p in params),
        filters=any(p.top_k > 0 or p.top_p < 1 for p in params),
        policies=tuple(sorted({p.policy for p in params if p.mode == "diffusion"})),
        early_stop=any(p.eos_early_stop and not p.ignore_eos for p in params),
        drafting=any(p.stream_drafts for p in params))


def graph_plan(rows: int, kv_len: int, scored: bool) -> RowPlan:
    """The plan of a CUDA graph of `rows` rows: every pass on; scores (all rows, MAX_LOGPROBS
    alternatives) or none."""
    return RowPlan(rows=rows, kv_len=kv_len, scored=tuple(range(rows)) if scored else (),
                   top_logprobs=MAX_LOGPROBS if scored else 0, sampling=True, filters=True,
                   policies=tuple(sorted(POLICIES)), early_stop=True, drafting=True)
