"""Canvas-wide rows of masked diffusion (docs/spec.md 3: denoise, commit) and linear speculation
(docs/spec.md 5: draft, verify) for Nemotron-Labs-Diffusion: one forward over every row's canvas, causal
for commit and verify rows, then every phase's decisions computed for all rows and kept where the row is
in that phase. Device ops only, so several steps run without the host.

AR rows may ride along (the runner decides): a causal row whose position 0 is its last token, so canvas
and AR rows read the weights once a step. Position 0 sees the keys the AR step's one-token row sees and
its noise is keyed by position, so it samples the token the AR step would; positions 1.. are computed
and ignored (their KV lies past the row's length, where the next step writes).
"""
from __future__ import annotations

import torch

from model.phases import AR, COMMIT, DENOISE, DONE, DRAFT, VERIFY
from model.sampling.params import DecodeParams
from model.sampling.reveal import POLICIES, reveal
from model.slots import Scores
from model.steps.compiled import CompiledUpdate, compile_updates_enabled
from model.steps.env import StepEnv
from model.steps.plan import RowPlan


def first_true(flags: torch.Tensor, default: int) -> torch.Tensor:
    """Index of the first True along the last dim, `default` where none: [R, C] -> [R]."""
    j = torch.arange(flags.shape[-1], device=flags.device)
    return torch.where(flags, j, default).amin(-1)


def contains_eos(tokens: torch.Tensor, count: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """[R]: an EOS among the first count[r] tokens of each row."""
    j = torch.arange(tokens.shape[-1], device=tokens.device)
    return (torch.isin(tokens, eos) & (j[None, :] < count[:, None])).any(-1)


class MaskedCanvasStep:
    needs_prediction = True   # a new canvas's position 0 is the preceding causal pass's prediction
    takes_ar_rows = True      # AR rows may share its forward (above)

    def __init__(self, env: StepEnv):
        self.env = env
        self.update = CompiledUpdate(self._update, compile_updates_enabled(env.device))

    def knobs(self, params: DecodeParams) -> dict:
        return {"gamma": params.reveal_entropy_bound}

    def admit(self, slots: list[int], knobs: list[dict]) -> None:
        pass   # every parameter masked diffusion reads is in the slot table

    def start(self, idx: torch.Tensor, where: torch.Tensor, prediction: torch.Tensor) -> None:
        """Rows idx where `where`: a masked canvas, position 0 the prediction if the row seeds it (docs/spec.md 3(a))."""
        t, C, MASK = self.env.slots, self.env.C, self.env.mask_id
        fresh = torch.full((len(idx), C), MASK, dtype=torch.int64, device=idx.device)
        fresh[:, 0] = torch.where(t.seed_first[idx], prediction, MASK)
        t.canvas[idx] = torch.where(where[:, None], fresh, t.canvas[idx])
        t.n[idx] = torch.where(where, 0, t.n[idx])
        t.phase[idx] = torch.where(where, DENOISE, t.phase[idx])

    def __call__(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor) -> None:
        r, t, C, MASK = self.env, self.env.slots, self.env.C, self.env.mask_id
        phase = t.phase[idx]
        is_ar = phase == AR
        first = torch.arange(C, device=idx.device) == 0
        tokens = torch.where(is_ar[:, None], torch.where(first, t.last_token[idx][:, None], MASK), t.canvas[idx])
        causal = (phase == COMMIT) | (phase == VERIFY) | is_ar
        # an AR row's one real token is its first: the rest of its row is padding, whose KV goes to the sink
        # (its page table covers the tokens it feeds, not a canvas)
        lengths = torch.where(is_ar, 1, C)
        hidden = r.forward(idx, tokens, t.length[idx], C, causal, plan.kv_len, lengths=lengths)
        x = r.logits(hidden, idx, plan.spans)                           # [B, C, V_r] raw, mask token -inf
        st = r.sampler.stats(x, idx, plan)
        scores = r.sampler.scores(x, st, st.x_sample[scored], scored, plan.top_logprobs, idx) if plan.scored else None
        r.observe("before", "canvas", idx, x)
        self.update(plan, idx, scored, st, scores)
        r.observe("after", "canvas", idx)

    def _update(self, plan: RowPlan, idx: torch.Tensor, scored: torch.Tensor, st, scores: Scores | None) -> None:
        """Every phase's decisions from the sampler's statistics, kept where the row is in that phase."""
        r, t, C, MASK = self.env, self.env.slots, self.env.C, self.env.mask_id
        phase, length, canvas, n = t.phase[idx], t.length[idx], t.canvas[idx], t.n[idx]
        is_denoise, is_commit = phase == DENOISE, phase == COMMIT
        is_draft, is_verify, is_ar = phase == DRAFT, phase == VERIFY, phase == AR
        live = phase != DONE

        # denoise: reveal candidates by the row's policy (docs/spec.md 3.3-3.7)
        masked = canvas == MASK
        confidence = torch.where(masked, st.x_sample - st.lse_u, -torch.inf)
        # a constrained row's frontier, sampled under its grammar, is revealed whatever the policy: each step
        # extends the valid text by a token at least (docs/spec.md 12)
        frontier = torch.arange(C, device=idx.device) == t.grammar_pos[idx][:, None]
        confidence = torch.where(frontier & masked, torch.inf, confidence)
        N = t.steps_limit[idx]
        # compiled, every policy and the early stop are computed (each row keeps its own): one compiled
        # variant serves every mix of policies, and the extra work fuses into few kernels
        compiling = torch.compiler.is_compiling()
        policies = tuple(POLICIES) if compiling else plan.policies
        revealed = reveal(t.policy[idx], list(policies), masked, n, N, confidence=confidence,
                          entropy=torch.where(frontier, 0.0, st.entropy_u) if "entropy_bound" in policies else None,
                          tau=t.tau[idx], gamma=t.gamma[idx]) & is_denoise[:, None]
        denoised = torch.where(revealed, st.sample, canvas)
        still_masked = denoised == MASK
        converged = ~still_masked.any(-1) | (n + 1 >= N)
        if compiling or plan.early_stop:
            clean_eos = (torch.isin(denoised, r.eos) & (torch.cumsum(still_masked.long(), -1) == 0)).any(-1)
            converged |= clean_eos & t.early_stop[idx]

        # commit: the block is the canvas up to its first mask (denoising stopped at a clean EOS)
        commit_count = first_true(canvas == MASK, C)
        next_token = st.sample[:, C - 1]
        # a converged canvas that ends the request is emitted now: its commit's forward would write KV
        # nothing reads and predict a seed nothing uses. A constrained row's commits (the grammar checks a
        # converged canvas before its commit, docs/spec.md 12)
        final_count = first_true(still_masked, C)
        final = is_denoise & converged & ~t.constrained[idx] & (
            (t.emitted[idx] + final_count >= t.max_tokens[idx])
            | (contains_eos(denoised, final_count, r.eos) & ~t.ignore_eos[idx]))

        # verify (greedy rows: the sampler's pick is the argmax)
        pred = st.sample
        agree = torch.cumprod((canvas[:, 1:] == pred[:, :-1]).long(), -1).sum(-1)
        budget = (t.max_tokens[idx] - t.emitted[idx]).clamp(min=1, max=C)
        accepted = torch.minimum(1 + agree, budget)
        after_accepted = torch.gather(pred, 1, (accepted - 1)[:, None]).squeeze(1)

        # ar: position 0's prediction is the next token
        ar_token = st.sample[:, 0]

        count = torch.where(is_commit, commit_count, torch.where(final, final_count, torch.where(
            is_verify, accepted, is_ar.long())))
        emitted = t.emitted[idx] + count
        block = torch.where(is_ar[:, None], st.sample, torch.where(final[:, None], denoised, canvas))
        eos_stop = contains_eos(block, count, r.eos) & ~t.ignore_eos[idx]
        stop = (emitted >= t.max_tokens[idx]) | eos_stop
        block_scores = None
        if scores is not None:
            block_scores = self._block_scores(idx[scored], is_commit[scored], final[scored], revealed[scored],
                                              is_ar[scored], scores, scores.k)
        r.outputs.emit(idx, block, count, (is_commit | final | is_verify).long(),
                       torch.where(is_commit, n, torch.where(final, n + 1, is_verify.long())), block_scores, scored)

        # the next canvas after a commit: the prediction at position 0 if the row seeds it (docs/spec.md 3(a))
        fresh = torch.full_like(canvas, MASK)
        fresh[:, 0] = torch.where(t.seed_first[idx], next_token, MASK)
        draft = torch.cat([t.last_token[idx][:, None], pred[:, 1:]], 1)
        t.canvas[idx] = torch.where(is_denoise[:, None], denoised, torch.where(
            is_commit[:, None], fresh, torch.where(is_draft[:, None], draft, canvas)))
        if scores is not None:
            self._keep_scores(idx[scored], revealed[scored], is_commit[scored], is_verify[scored],
                              accepted[scored], scores)
        t.phase[idx] = torch.where(final, DONE, torch.where(is_denoise & converged, COMMIT, torch.where(
            is_commit, torch.where(stop, DONE, DENOISE), torch.where(
                is_draft, VERIFY, torch.where(
                    is_verify, torch.where(stop, DONE, DRAFT), torch.where(is_ar & stop, DONE, phase))))))
        t.n[idx] = torch.where(is_denoise, n + 1, torch.where(is_commit, 0, n))
        t.length[idx] = length + torch.where(is_commit, C, torch.where(is_verify, accepted, is_ar.long()))
        t.emitted[idx] = emitted
        t.last_token[idx] = torch.where(is_verify, after_accepted, torch.where(is_ar, ar_token, t.last_token[idx]))
        t.draws[idx] += live.long()
        if plan.drafting:
            r.drafts.record(idx, denoised, ~still_masked, n + 1, is_denoise, length)
        denoising = (is_denoise | is_draft).long().sum()
        r.outputs.add_counters(committed_tokens=((is_commit | final).long() * C + is_verify.long() * accepted
                                                 + is_ar.long()).sum(),
                               denoising_steps=denoising, canvas_positions=denoising * C,
                               canvases=(is_commit | final | is_verify).long().sum(), forwards=live.long().sum(),
                               passes=1)

    def _block_scores(self, slots: torch.Tensor, is_commit: torch.Tensor, final: torch.Tensor,
                      revealed: torch.Tensor, is_ar: torch.Tensor, scores: Scores, k: int) -> Scores:
        """A commit emits the canvas's reveal-time scores (a final canvas: with those of the positions this
        step revealed); a verify emits the seed's score, then the causal scores of the draft's positions
        j >= 1, predicted at j - 1; an AR row its position 0's (docs/spec.md 6)."""
        t = self.env.slots
        kept = t.canvas_scores.read(slots, k)
        canvas = scores.where(final[:, None] & revealed, kept)
        seed = t.seed_scores.read(slots, k)

        def shift(a, b):
            return None if a is None else torch.cat([a, b[:, :-1]], 1)

        verified = Scores(shift(seed.logprob, scores.logprob), shift(seed.rank, scores.rank),
                          shift(seed.top_values, scores.top_values), shift(seed.top_ids, scores.top_ids))
        return canvas.where((is_commit | final)[:, None], scores.where(is_ar[:, None], verified))

    def _keep_scores(self, slots, revealed, is_commit, is_verify, accepted, scores: Scores) -> None:
        """Reveal-time scores: denoise rows keep those of the positions they revealed; a commit row keeps
        its seeded position 0's (the prediction at the last position); a verify row the next seed's."""
        t, C = self.env.slots, self.env.C
        t.canvas_scores.write(slots, revealed, scores)
        position0 = torch.zeros_like(revealed)
        position0[:, 0] = is_commit
        t.canvas_scores.write(slots, position0, scores.at(torch.full_like(accepted, C - 1)).expand(C))
        t.seed_scores.write(slots, is_verify[:, None], scores.at(accepted - 1))
