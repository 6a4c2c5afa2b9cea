"""Uniform-noise diffusion with self-conditioning: DiffusionGemma's sampler (SPEC.md 4), on
vocabulary-sharded logits, following transformers' generation_diffusion_gemma.py.

Per denoise step n of N, for R rows of [C] canvas positions (logits already softcapped by the model):
    scaled    = filter(logits) / T,  T = t_min + (t_max - t_min) * max(N - n, 1) / N
    sample    = argmax(scaled + Gumbel)                         (the request's own counter-based noise)
    argmax    = argmax(scaled)
    H         = entropy(softmax(scaled)) per position
    accepted  = the longest prefix of positions sorted by H ascending with cumsum(H) - max(H) <= bound
    canvas'   = accepted ? sample : uniform random token over the whole vocabulary
    converged = (argmax unchanged over stability_threshold + 1 steps and mean(H) < confidence) or n + 1 >= N
    soft'     = softmax(scaled) @ W_embed * sqrt(hidden)        (next step's self-conditioning input)
The commit feeds and emits the argmax canvas. Every rank computes the same decisions from all-reduced
statistics and identical noise; nothing here reads a device value on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.parallel import reductions as R
from model.parallel.group import TPGroup
from model.sampling.filters import scale_and_filter
from model.sampling.noise import STREAM_RENOISE, gumbel, uniform


def temperature(n: torch.Tensor, steps: torch.Tensor, t_min: torch.Tensor, t_max: torch.Tensor) -> torch.Tensor:
    """[R]: the linear schedule from t_max (n = 0) down to t_min + (t_max - t_min) / N (n = N - 1).
    transformers counts steps remaining, cur_step = N - n, and uses T = t_min + (t_max - t_min) * cur_step / N."""
    remaining = torch.clamp(steps - n, min=1).to(torch.float32)
    return t_min + (t_max - t_min) * remaining / steps.to(torch.float32)


def filter_and_scale(logits: torch.Tensor, temp: torch.Tensor, vocab_start: int, tp: TPGroup,
                     top_k: torch.Tensor | None = None, top_k_max: int = 0,
                     top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, C, V_r] (softcapped) -> filter(logits) / T. Top-k / top-p act on the softcapped logits
    before the temperature, the order of transformers' logits processors (user ones run first)."""
    if top_k is not None or top_p is not None:
        ones = torch.ones_like(temp)
        logits, _ = scale_and_filter(logits, ones, vocab_start, tp, top_k=top_k, top_k_max=top_k_max, top_p=top_p)
    return logits / temp.view(-1, 1, 1)


def random_tokens(seed: torch.Tensor, counter: torch.Tensor, positions: int, vocab_size: int) -> torch.Tensor:
    """[R, positions] uniform over the whole vocabulary: a canvas's initial tokens and its renoise.
    One counter-based uniform per position (STREAM_RENOISE), identical on every rank."""
    u = uniform(seed, counter, STREAM_RENOISE, positions, 0, 1)[..., 0]
    return torch.clamp((u * vocab_size).to(torch.int64), max=vocab_size - 1)


def softmax_stats(scaled: torch.Tensor, tp: TPGroup, soft_dtype: torch.dtype = torch.float32):
    """scaled [R, C, V_r] -> (entropy [R, C], log_norm [R, C]) with two all-reduces (max; then Z, A and,
    for a low-precision model, Z of the rounded logits, stacked). log_norm normalises the probabilities
    of self-conditioning, which transformers takes from the logits rounded to the embedding dtype."""
    m = R.global_max(scaled, tp)
    m = torch.where(torch.isfinite(m), m, 0)
    shifted = scaled - m.unsqueeze(-1)
    e = torch.exp(shifted)
    parts = [e.sum(dim=-1), torch.where(e > 0, e * shifted, 0).sum(dim=-1)]
    rounded = soft_dtype != torch.float32
    if rounded:  # rounding is monotone, so the rounded logits' maximum is the rounded maximum
        m_soft = m.to(soft_dtype).float()
        parts.append(torch.exp(scaled.to(soft_dtype).float() - m_soft.unsqueeze(-1)).sum(dim=-1))
    sums = tp.all_reduce(torch.stack(parts))
    z, a = sums[0], sums[1]
    log_norm = m_soft + torch.log(sums[2]) if rounded else m + torch.log(z)
    return torch.log(z) - a / z, log_norm


def probabilities(scaled: torch.Tensor, log_norm: torch.Tensor,
                  soft_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's slice [R, C, V_r] of the globally normalised softmax(scaled), fp32."""
    if soft_dtype != torch.float32:
        scaled = scaled.to(soft_dtype).float()
    return torch.exp(scaled - log_norm.unsqueeze(-1))


def entropy_bound_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[R, C] bool: positions sorted by entropy ascending, the longest prefix with
    cumsum(H) - max(H) <= bound (max = the last one, sorted); the first always qualifies (0 <= bound)."""
    sorted_h, order = torch.sort(entropy, dim=-1, stable=True)
    keep = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound.view(-1, 1)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def convergence(argmax: torch.Tensor, prev_argmax: torch.Tensor, run: torch.Tensor, entropy: torch.Tensor,
                n: torch.Tensor, steps: torch.Tensor, stability_threshold: torch.Tensor,
                confidence_threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (run', converged) [R]. `run` counts consecutive steps whose argmax canvas equalled the step
    before (0 at a canvas start, where prev_argmax is -1): transformers' history of the last
    `stability_threshold` argmax canvases all equal to this one is exactly run' >= stability_threshold."""
    run = torch.where((argmax == prev_argmax).all(dim=-1), run + 1, 0)
    stable = run >= stability_threshold
    confident = entropy.mean(dim=-1) < confidence_threshold
    return run, (stable & confident) | (n + 1 >= steps)


def self_condition_embedding(probs: torch.Tensor, embed: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """sum_r P_r W_r = P W: probs [..., V_r] this rank's slice of the globally normalised softmax,
    embed [V_r, H] this rank's rows of the embedding -> [..., H], identical on every rank. One all-reduce
    (summed in fp32); at TP = 1 neither a collective nor a copy of the table."""
    partial = torch.matmul(probs, embed)
    if not tp.is_parallel:
        return partial
    return tp.all_reduce(partial.to(torch.promote_types(partial.dtype, torch.float32))).to(partial.dtype)


@dataclass
class RenoiseStep:
    canvas: torch.Tensor       # [R, C] int64: the next step's input canvas
    sample: torch.Tensor       # [R, C] int64: the Gumbel-max sample at T (kept where accepted)
    argmax: torch.Tensor       # [R, C] int64: what a commit feeds and emits
    scaled: torch.Tensor       # [R, C, V_r]: filter(logits) / T, the distribution of logprobs
    probs: torch.Tensor        # [R, C, V_r] fp32: this rank's slice of softmax(scaled) for self-conditioning
    entropy: torch.Tensor      # [R, C]
    accepted: torch.Tensor     # [R, C] bool
    run: torch.Tensor          # [R] the stability run counter to keep
    converged: torch.Tensor    # [R] bool: the slot's next step is its commit


def renoise_step(logits: torch.Tensor, *, n: torch.Tensor, steps: torch.Tensor, t_min: torch.Tensor,
                 t_max: torch.Tensor, entropy_bound: torch.Tensor, stability_threshold: torch.Tensor,
                 confidence_threshold: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                 prev_argmax: torch.Tensor, run: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPGroup,
                 top_k: torch.Tensor | None = None, top_k_max: int = 0, top_p: torch.Tensor | None = None,
                 soft_dtype: torch.dtype = torch.float32) -> RenoiseStep:
    """One denoise step's sampler for R rows. logits [R, C, V_r] fp32, softcapped; every other tensor
    [R] (prev_argmax [R, C]). `counter` is each row's draw counter for this step (one value covers the
    Gumbel and the renoise streams); `soft_dtype` the embedding dtype (self-conditioning rounding)."""
    temp = temperature(n, steps, t_min, t_max)
    scaled = filter_and_scale(logits, temp, vocab_start, tp, top_k, top_k_max, top_p)
    positions = scaled.shape[1]
    g = gumbel(seed, counter, positions, vocab_start, scaled.shape[-1])
    # filtered (-inf) entries stay -inf whatever the noise
    sample = R.argmax(torch.where(torch.isfinite(scaled), scaled + g, scaled), vocab_start, tp)
    argmax = R.argmax(scaled, vocab_start, tp)
    entropy, log_norm = softmax_stats(scaled, tp, soft_dtype)
    accepted = entropy_bound_accept(entropy, entropy_bound)
    canvas = torch.where(accepted, sample, random_tokens(seed, counter, positions, vocab_size))
    run, converged = convergence(argmax, prev_argmax, run, entropy, n, steps, stability_threshold,
                                 confidence_threshold)
    return RenoiseStep(canvas=canvas, sample=sample, argmax=argmax, scaled=scaled,
                       probs=probabilities(scaled, log_norm, soft_dtype), entropy=entropy, accepted=accepted,
                       run=run, converged=converged)
