"""What a command's rows ask for, decided on the host once per command: the row set of each step kind
and the sampler work it needs. A step's code depends only on its plan (and its rows' device state), so
a plan is also the key of the step's CUDA graph: replays serve any slots with the same plan."""
from __future__ import annotations

from dataclasses import dataclass

from model.slots import SlotInfo


@dataclass(frozen=True)
class RowPlan:
    rows: int                      # B
    scored: tuple[int, ...]        # rows (0..B-1) whose requests asked for logprobs
    top_logprobs: int              # k of top-k alternatives: the max over scored rows (0: none)
    sampling: bool                 # any row with temperature > 0 (else no Gumbel noise is drawn)
    filter_top_k: int              # max top_k over rows (0: no top-k filter)
    filter_top_p: bool             # any row with top_p < 1
    policies: tuple[str, ...]      # reveal policies present (masked diffusion)
    modes: tuple[str, ...]         # decoding modes present
    early_stop: bool               # any row stopping denoising at a clean EOS
    kv_len: int                    # keys a row may read during the command
    drafting: tuple[int, ...] = ()  # rows (0..B-1) whose requests stream drafts (model/drafts.py)

    @property
    def filters(self) -> bool:
        return bool(self.filter_top_k or self.filter_top_p)


def plan_rows(infos: list[SlotInfo], kv_len: int, uniform_noise: bool) -> RowPlan:
    params = [i.params for i in infos]
    scored = tuple(r for r, i in enumerate(infos) if i.wants_scores)
    return RowPlan(
        rows=len(infos), scored=scored,
        top_logprobs=max((params[r].logprobs for r in scored), default=0),
        # uniform noise always samples (its temperature comes from the schedule)
        sampling=uniform_noise or any(p.effective_temperature > 0 for p in params),
        filter_top_k=max(p.top_k for p in params), filter_top_p=any(p.top_p < 1 for p in params),
        policies=tuple(sorted({p.policy for p in params if p.mode == "diffusion"})),
        modes=tuple(sorted({p.mode for p in params})),
        early_stop=any(p.eos_early_stop and not p.ignore_eos for p in params),
        kv_len=kv_len, drafting=tuple(r for r, p in enumerate(params) if p.stream_drafts))
