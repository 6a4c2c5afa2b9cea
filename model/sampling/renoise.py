"""Uniform-noise diffusion with self-conditioning: DiffusionGemma's sampler (docs/spec.md 4), on
vocabulary-sharded logits, following transformers' generation_diffusion_gemma.py.

One denoise step of R rows: the scheduled temperature, the Gumbel-max sample and the argmax of the
filtered, softcapped logits over T, their entropies, entropy-bound acceptance, the next canvas (accepted
samples, fresh uniform tokens elsewhere), convergence, and this rank's slice of softmax(logits / T) for
the next step's self-conditioning (sum_r P_r W_r, one all-reduce). The statistics come from one pass over
each rank's slice (model.sampling.stats); every rank computes the same decisions from their all-reduced
combination and identical noise, and nothing here reads a device value on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch_invariant import linear, row_cumsum, row_mean
from model.parallel.group import TPGroup
from model.sampling.noise import STREAM_RENOISE, uniform
from model.sampling.stats import TORCH_PASSES, VocabPasses, VocabStats, vocab_stats


def temperature(n: torch.Tensor, steps: torch.Tensor, t_min: torch.Tensor, t_max: torch.Tensor) -> torch.Tensor:
    """[R]: the linear schedule from t_max (n = 0) down to t_min + (t_max - t_min) / N (n = N - 1).
    transformers counts steps remaining, cur_step = N - n, and uses T = t_min + (t_max - t_min) * cur_step / N."""
    remaining = torch.clamp(steps - n, min=1).to(torch.float32)
    return t_min + (t_max - t_min) * remaining / steps.to(torch.float32)


def random_tokens(seed: torch.Tensor, counter: torch.Tensor, positions: int, vocab_size: int) -> torch.Tensor:
    """[R, positions] uniform over the whole vocabulary: a canvas's initial tokens and its renoise.
    One counter-based uniform per position (STREAM_RENOISE), identical on every rank."""
    u = uniform(seed, counter, STREAM_RENOISE, positions, 0, 1)[..., 0]
    return torch.clamp((u * vocab_size).to(torch.int64), max=vocab_size - 1)


def entropy_bound_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[R, C] bool: positions sorted by entropy ascending, the longest prefix with
    cumsum(H) - max(H) <= bound (max = the last one, sorted); the first always qualifies (0 <= bound)."""
    sorted_h, order = torch.sort(entropy, dim=-1, stable=True)
    keep = row_cumsum(sorted_h) - sorted_h <= bound.view(-1, 1)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def convergence(argmax: torch.Tensor, prev_argmax: torch.Tensor, run: torch.Tensor, entropy: torch.Tensor,
                n: torch.Tensor, steps: torch.Tensor, stability_threshold: torch.Tensor,
                confidence_threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (run', converged) [R]. `run` counts consecutive steps whose argmax canvas equalled the step
    before (0 at a canvas start, where prev_argmax is -1): transformers' history of the last
    `stability_threshold` argmax canvases all equal to this one is exactly run' >= stability_threshold."""
    run = torch.where((argmax == prev_argmax).all(dim=-1), run + 1, 0)
    stable = run >= stability_threshold
    confident = row_mean(entropy) < confidence_threshold
    return run, (stable & confident) | (n + 1 >= steps)


def self_condition_embedding(probs: torch.Tensor, embed: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """sum_r P_r W_r = P W: probs [..., V_r] this rank's slice of the globally normalised softmax,
    embed [V_r, H] this rank's rows of the embedding -> [..., H], identical on every rank. One all-reduce
    (summed in fp32); at TP = 1 neither a collective nor a copy of the table."""
    partial = linear(probs, embed.t())
    if not tp.is_parallel:
        return partial
    return tp.all_reduce(partial.to(torch.promote_types(partial.dtype, torch.float32))).to(partial.dtype)


@dataclass
class RenoiseStep:
    canvas: torch.Tensor       # [R, C] int64: the next step's input canvas
    sample: torch.Tensor       # [R, C] int64: the Gumbel-max sample at T (kept where accepted)
    argmax: torch.Tensor       # [R, C] int64: what a commit feeds and emits
    stats: VocabStats          # the distribution of logprobs (s = filtered u / T)
    probs: torch.Tensor        # [R, C, V_r] (probs_dtype): this rank's slice of softmax(s), for self-conditioning
    entropy: torch.Tensor      # [R, C]
    accepted: torch.Tensor     # [R, C] bool
    run: torch.Tensor          # [R] the stability run counter to keep
    converged: torch.Tensor    # [R] bool: the slot's next step is its commit


def renoise_step(logits: torch.Tensor, *, n: torch.Tensor, steps: torch.Tensor, t_min: torch.Tensor,
                 t_max: torch.Tensor, entropy_bound: torch.Tensor, stability_threshold: torch.Tensor,
                 confidence_threshold: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                 prev_argmax: torch.Tensor, run: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPGroup,
                 threshold: torch.Tensor | None = None, soft_dtype: torch.dtype | None = None,
                 softcap: float | None = None, passes: VocabPasses = TORCH_PASSES,
                 probs_dtype: torch.dtype = torch.float32) -> RenoiseStep:
    """One denoise step's sampler for R rows. logits [R, C, V_r]: this rank's raw LM-head output, softcapped
    here with `softcap` (None: already softcapped); every other tensor [R] (prev_argmax [R, C]).
    `counter` is each row's draw counter for this step (one value covers the Gumbel and the renoise
    streams); `threshold` [R, C] the filters' smallest kept softcapped logit (None: no filter);
    `soft_dtype` the embedding dtype (self-conditioning rounding); `probs_dtype` the probabilities'."""
    temp = temperature(n, steps, t_min, t_max)
    st = vocab_stats(logits, temp, seed, counter, vocab_start, tp, softcap=softcap, threshold=threshold,
                     threshold_on_scaled=False, soft_dtype=soft_dtype, passes=passes)
    positions = logits.shape[1]
    accepted = entropy_bound_accept(st.entropy_s, entropy_bound)
    canvas = torch.where(accepted, st.sample, random_tokens(seed, counter, positions, vocab_size))
    run, converged = convergence(st.greedy, prev_argmax, run, st.entropy_s, n, steps, stability_threshold,
                                 confidence_threshold)
    probs = passes.probabilities(logits, temp, st.lse_soft, softcap=softcap, threshold=threshold,
                                 threshold_on_scaled=False, soft_dtype=soft_dtype, out_dtype=probs_dtype)
    return RenoiseStep(canvas=canvas, sample=st.sample, argmax=st.greedy, stats=st, probs=probs, entropy=st.entropy_s,
                       accepted=accepted, run=run, converged=converged)
