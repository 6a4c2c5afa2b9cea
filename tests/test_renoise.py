"""DiffusionGemma's sampler (model/sampling/renoise.py, docs/spec.md 4) against transformers'
generation_diffusion_gemma.py: the temperature schedule, entropy-bound acceptance, uniform renoising,
the stable-and-confident stopping rule and the self-conditioning logits, given the same logits and the
same random draws (ours fed into the reference in place of torch.multinomial and torch.randint)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper
from transformers.models.diffusion_gemma import generation_diffusion_gemma as G

from model.parallel.group import TPGroup
from model.sampling import renoise as RN
from model.sampling.filters import keep_threshold
from model.sampling.stats import probabilities, vocab_stats

TP1 = TPGroup()


def softcap(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x / 30) * 30


def rows(r: int, value, dtype=torch.float32) -> torch.Tensor:
    return torch.full((r,), value, dtype=dtype)


def test_temperature_schedule_matches_reference():
    N = 48
    proc = G.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=N)
    n = torch.arange(N)
    ours = RN.temperature(n, rows(N, N, torch.int64), rows(N, 0.4), rows(N, 0.8))
    for step in range(N):  # transformers iterates cur_step = N .. 1, the steps remaining
        ref = 1 / proc(None, torch.ones(1), cur_step=N - step)
        assert math.isclose(ours[step].item(), ref.item(), rel_tol=1e-6)
    assert ours[0].item() == pytest.approx(0.8) and ours[-1].item() == pytest.approx(0.4 + 0.4 / N)


class Reference:
    """transformers' own denoising step (DiffusionGemmaGenerationMixin._denoising_step) around a decoder
    that returns given logits, its sampler and stopping criteria kept across steps, with our draws."""

    def __init__(self, vocab: int, canvas_length: int, steps: int, entropy_bound: float, stability: int,
                 confidence: float, extra_processors=()):
        self.steps = steps
        self.sampler = G.EntropyBoundSampler(G.EntropyBoundSamplerConfig(entropy_bound=entropy_bound),
                                             canvas_length, vocab, steps)
        self.criteria = G.StableAndConfidentStoppingCriteria(stability, confidence)
        self.processors = LogitsProcessorList([*extra_processors,
                                               G.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, steps)])
        self.owner = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(vocab_size=vocab)),
                                     model=SimpleNamespace(decoder=SimpleNamespace(
                                         embed_tokens=SimpleNamespace(weight=torch.empty(0)))))

    def step(self, monkeypatch, n, canvas, argmax, sc_logits, finished, logits, sample, renoise):
        monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples: sample.reshape(-1, 1))
        monkeypatch.setattr(self.sampler, "initialize_canvas", lambda batch_size, device: renoise)
        out = G.DiffusionGemmaGenerationMixin._denoising_step(
            self.owner, decoder_forward=lambda **kw: SimpleNamespace(logits=logits), current_canvas=canvas,
            argmax_canvas=argmax, input_ids=None, decoder_position_ids=None, self_conditioning_logits=sc_logits,
            mask_mapping=None, past_key_values=None, finished_denoising=finished, cur_step=self.steps - n,
            sampler=self.sampler, logits_processor=self.processors, diffusion_stopping_criteria=self.criteria)
        monkeypatch.undo()
        return out, self.sampler.accepted_token_mask


def step_logits(gen: torch.Generator, n: int, R: int, C: int, V: int) -> torch.Tensor:
    """Softcapped logits for 3 kinds of rows: 0 peaked with a fixed argmax (converges once stable),
    1 peaked with an argmax that moves every step (never stable), 2 a mix of peaked and flat positions
    (partial acceptance, renoising)."""
    x = torch.randn(R, C, V, generator=gen)
    target = torch.arange(C)[None].repeat(R, 1) % V
    target[1] = (target[1] + n) % V
    peak = torch.full((R, C), 40.0)
    peak[2, ::3] = 0.0                                      # flat positions on row 2
    peak[2, 1::3] = 3.0
    x.scatter_add_(-1, target[..., None], peak[..., None])
    return softcap(x)


@pytest.mark.parametrize("stability", [0, 1, 2])
def test_denoising_steps_match_reference(monkeypatch, stability):
    R, C, V, N, bound = 3, 16, 50, 8, 0.1
    gen = torch.Generator().manual_seed(stability)
    ref = Reference(V, C, N, bound, stability, 0.005)
    seed = torch.tensor([11, 22, 2**40 + 3])
    canvas = RN.random_tokens(seed, torch.zeros(R, dtype=torch.int64), C, V)      # counter 0: the init
    ref_canvas, ref_argmax, sc, finished = canvas.clone(), canvas.clone(), None, torch.zeros(R, dtype=torch.bool)
    prev, run = torch.full((R, C), -1), torch.zeros(R, dtype=torch.int64)
    converged_at = {}
    for n in range(N):
        logits = step_logits(gen, n, R, C, V)
        out = RN.renoise_step(logits, n=rows(R, n, torch.int64), steps=rows(R, N, torch.int64),
                              t_min=rows(R, 0.4), t_max=rows(R, 0.8), entropy_bound=rows(R, bound),
                              stability_threshold=rows(R, stability, torch.int64),
                              confidence_threshold=rows(R, 0.005), seed=seed, counter=rows(R, n + 1, torch.int64),
                              prev_argmax=prev, run=run, vocab_start=0, vocab_size=V, tp=TP1)
        renoise = RN.random_tokens(seed, rows(R, n + 1, torch.int64), C, V)
        was_finished = finished.clone()
        (ref_canvas, ref_argmax, sc, finished), accepted = ref.step(
            monkeypatch, n, ref_canvas, ref_argmax, sc, finished, logits, out.sample, renoise)
        live = ~was_finished  # transformers freezes finished rows; ours commit instead
        assert torch.equal(out.accepted[live], accepted[live])
        assert torch.equal(out.canvas[live], ref_canvas[live])
        assert torch.equal(out.argmax[live], ref_argmax[live])
        assert torch.allclose(out.probs[live], torch.softmax(sc.float(), dim=-1)[live], atol=1e-6)
        last = n + 1 == N  # transformers' loop simply ends there
        assert torch.equal(out.converged[live], (finished | last)[live])
        # acceptance is decided with a margin: the comparison is not a coin toss on rounding
        sorted_h = torch.sort(out.entropy, dim=-1).values
        assert ((torch.cumsum(sorted_h, -1) - sorted_h - bound).abs() > 1e-5).all()
        for r in range(R):
            if out.converged[r] and r not in converged_at:
                converged_at[r] = n
        prev, run = out.argmax, out.run
    assert 0 < out.accepted[2].sum() < C  # row 2 really mixes accepted and renoised positions
    # row 1 is confident but never stable: only stability 0 (no stability requirement) stops it early
    assert converged_at == {0: stability, 1: 0 if stability == 0 else N - 1, 2: N - 1}


class Flat:
    """transformers' warpers take [batch, vocab] (top-p scatters along dim 1): apply one per position."""

    def __init__(self, warper):
        self.warper = warper

    def __call__(self, input_ids, scores):
        return self.warper(input_ids, scores.reshape(-1, scores.shape[-1])).view_as(scores)


@pytest.mark.parametrize("kind", ["top_k", "top_p"])
def test_filters_apply_before_the_temperature_like_reference_processors(monkeypatch, kind):
    R, C, V, N = 2, 8, 40, 4
    gen = torch.Generator().manual_seed(5)
    logits = softcap(torch.randn(R, C, V, generator=gen) * 3)
    seed, counter = torch.tensor([1, 2]), rows(R, 7, torch.int64)
    extra = Flat(TopKLogitsWarper(5) if kind == "top_k" else TopPLogitsWarper(0.7))
    filt = {"top_k": rows(R, 5, torch.int64)} if kind == "top_k" else {"top_p": rows(R, 0.7)}
    threshold = keep_threshold(logits, 0, TP1, **filt)   # decided on the softcapped logits, before T
    out = RN.renoise_step(logits, n=rows(R, 1, torch.int64), steps=rows(R, N, torch.int64), t_min=rows(R, 0.4),
                          t_max=rows(R, 0.8), entropy_bound=rows(R, 0.5), stability_threshold=rows(R, 1, torch.int64),
                          confidence_threshold=rows(R, 0.005), seed=seed, counter=counter,
                          prev_argmax=torch.full((R, C), -1), run=torch.zeros(R, dtype=torch.int64),
                          vocab_start=0, vocab_size=V, tp=TP1, threshold=threshold)
    ref = Reference(V, C, N, 0.5, 1, 0.005, extra_processors=[extra])
    canvas = torch.zeros(R, C, dtype=torch.int64)
    renoise = RN.random_tokens(seed, counter, C, V)
    (ref_canvas, ref_argmax, sc, _), accepted = ref.step(monkeypatch, 1, canvas, canvas, None,
                                                        torch.zeros(R, dtype=torch.bool), logits, out.sample, renoise)
    kept = logits >= threshold.unsqueeze(-1)
    assert 0 < kept.sum() < kept.numel() and torch.equal(kept, torch.isfinite(sc))  # the same candidates
    assert torch.equal(kept, out.probs > 0)    # self-conditioning reads only the candidates
    assert torch.equal(out.accepted, accepted) and torch.equal(out.canvas, ref_canvas)
    assert torch.equal(out.argmax, ref_argmax)
    assert torch.gather(kept, -1, out.sample[..., None]).all()  # samples are candidates


def test_convergence_matches_reference_stopping_criteria():
    """Random argmax sequences over few values (so repeats happen) and entropies either side of the
    confidence threshold, for stability thresholds 0..3."""
    gen = torch.Generator().manual_seed(9)
    R, C, V, steps = 6, 4, 3, 12
    for stability in range(4):
        ref = G.StableAndConfidentStoppingCriteria(stability, 0.05)
        prev, run = torch.full((R, C), -1), torch.zeros(R, dtype=torch.int64)
        for n in range(steps):
            argmax = torch.randint(0, 2, (R, 1), generator=gen).expand(R, C).clone()
            argmax[0] = 1                                                  # row 0: always the same
            logits = torch.randn(R, C, V, generator=gen) * torch.tensor([30.0, 30, 30, 1, 30, 0.1]).view(R, 1, 1)
            entropy = torch.distributions.Categorical(logits=logits).entropy()
            run, ours = RN.convergence(argmax, prev, run, entropy, rows(R, n, torch.int64),
                                       rows(R, 100, torch.int64), rows(R, stability, torch.int64), rows(R, 0.05))
            assert torch.equal(ours, ref(argmax, logits)), (stability, n)
            prev = argmax


def test_confidence_zero_runs_every_step():
    R, C = 2, 4
    argmax, entropy = torch.zeros(R, C, dtype=torch.int64), torch.zeros(R, C)
    run = torch.zeros(R, dtype=torch.int64)
    for n in range(5):
        run, done = RN.convergence(argmax, argmax, run, entropy, rows(R, n, torch.int64), rows(R, 5, torch.int64),
                                   rows(R, 1, torch.int64), rows(R, 0.0))
        assert done.tolist() == [n == 4] * R


def test_gumbel_samples_follow_softmax_and_renoise_is_uniform():
    """20000 positions of one row share the logits: sample frequencies within 4 sigma of softmax(x / T);
    random tokens within 4 sigma of uniform; both depend only on (seed, counter)."""
    P, V = 20000, 7
    x = softcap(torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 3.0, -2.0]))
    logits = x.expand(1, P, V).clone()
    args = dict(n=rows(1, 0, torch.int64), steps=rows(1, 4, torch.int64), t_min=rows(1, 0.4), t_max=rows(1, 0.8),
                entropy_bound=rows(1, 0.1), stability_threshold=rows(1, 1, torch.int64),
                confidence_threshold=rows(1, 0.005), seed=torch.tensor([123]), counter=rows(1, 3, torch.int64),
                prev_argmax=torch.full((1, P), -1), run=torch.zeros(1, dtype=torch.int64), vocab_start=0,
                vocab_size=V, tp=TP1)
    out = RN.renoise_step(logits, **args)
    p = torch.softmax(x / 0.8, dim=-1)
    freq = torch.bincount(out.sample[0], minlength=V) / P
    assert ((freq - p).abs() <= 4 * torch.sqrt(p * (1 - p) / P)).all()
    tokens = RN.random_tokens(torch.tensor([123]), rows(1, 3, torch.int64), P, V)[0]
    freq = torch.bincount(tokens, minlength=V) / P
    assert ((freq - 1 / V).abs() <= 4 * math.sqrt((1 / V) * (1 - 1 / V) / P)).all()
    assert torch.equal(RN.renoise_step(logits, **args).sample, out.sample)   # deterministic
    other = RN.random_tokens(torch.tensor([123, 124]), torch.tensor([4, 3]), P, V)
    assert (other[0] != tokens).float().mean() > 0.5 and (other[1] != tokens).float().mean() > 0.5


def test_low_precision_self_conditioning_rounds_logits_like_reference():
    """transformers casts the processed logits to the embedding dtype before its fp32 softmax."""
    gen = torch.Generator().manual_seed(4)
    scaled = torch.randn(2, 5, 300, generator=gen) * 8
    scaled[0, 0, :100] = -torch.inf
    ones, zeros = torch.ones(2), torch.zeros(2, dtype=torch.int64)
    for dtype in (torch.float32, torch.bfloat16):
        st = vocab_stats(scaled, ones, zeros, zeros, 0, TP1, sampling=False,
                         soft_dtype=None if dtype == torch.float32 else dtype)
        entropy, probs = st.entropy_s, probabilities(scaled, st.lse_soft, dtype)
        expected = torch.softmax(scaled.to(dtype), dim=-1, dtype=torch.float32)
        assert torch.allclose(probs, expected, atol=1e-6)
        assert torch.allclose(entropy, torch.distributions.Categorical(logits=scaled).entropy(), atol=1e-5)
