"""FP8 checkpoints, numerics (model/fp8.py): the FP8 model of either family against its twin, the
unquantized model holding the checkpoint as compressed-tensors decompresses it (tests/fp8_reference.py).

- Exactly: the FP8 model is the twin with every quantized layer's input rounded to FP8 per token by
  compressed-tensors' own dynamic quantization, bit for bit, in a forward schedule and through the
  in-process Engine (tokens and logprobs); with our rounding replaced by the identity it is the twin.
- Within a derived bound: the FP8 model's logits against the twin's (test_logits_within_the_bound...).

Greedy tokens are not compared with the plain twin: on these random tiny models the top two logits are
often within the FP8 error of each other (margins under 0.1 are common), and such a near-tie may fall
either way; the Engine test above compares with the twin plus the rounding instead, exactly.
"""
from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

import model.fp8
import model.moe
from model.loader import load_model
from model.moe import GemmaRouter
from model.parallel.group import TPGroup
from model.sampling.params import DecodeParams
from tests import served
from tests.fp8_reference import ct_activation_rounding, fp8_modules, schedule
from workers.engine import Engine

TP1 = TPGroup()


@pytest.fixture(scope="module")
def checkpoints(fp8_checkpoints):
    """family -> (FP8 checkpoint, its twin decompressed by compressed-tensors)."""
    return fp8_checkpoints


@contextlib.contextmanager
def activation_rounding(fn):
    """The FP8 layers' activation rounding (model.fp8.fake_quantize_per_token) replaced by fn(x, dtype)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.fp8, "fake_quantize_per_token", fn)
        mp.setattr(model.moe, "fake_quantize_per_token", fn)
        yield


@contextlib.contextmanager
def pinned_routing(net, log: list, replay: bool):
    """DiffusionGemma's routers record each call's expert ids in `log`, or (replay) take them from it in
    call order, weighting them as the router does (softmax, renormalised over the k, scaled): the model
    is then a continuous function of its activations around those routing decisions."""
    calls = iter(log)

    def pinned(router, normed):
        ids = next(calls)
        probs = torch.softmax(router.proj(normed), dim=-1, dtype=torch.promote_types(normed.dtype, torch.float32))
        weights = probs.gather(-1, ids)
        return weights / weights.sum(-1, keepdim=True) * router.per_expert_scale[ids], ids

    def recorded(router, normed):
        weights, ids = GemmaRouter.forward(router, normed)
        log.append(ids)
        return weights, ids

    routers = [m for m in net.modules() if isinstance(m, GemmaRouter)]
    for router in routers:
        router.forward = (lambda normed, r=router: pinned(r, normed)) if replay else \
            (lambda normed, r=router: recorded(r, normed))
    try:
        yield
    finally:
        for router in routers:
            del router.forward
    if replay:
        assert next(calls, None) is None, "a replay took fewer routing decisions than were recorded"


# --------------------------------------------------------------------------------------------------
# Exactly

@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_fp8_model_is_its_twin_with_compressed_tensors_activation_rounding(checkpoints, family):
    fp8_dir, twin_dir = checkpoints[family]
    ours, twin = load_model(fp8_dir, show_progress=False), load_model(twin_dir, show_progress=False)
    got = schedule(ours, TP1)
    with ct_activation_rounding(twin, fp8_modules(fp8_dir, twin)):
        expected = schedule(twin, TP1)
    plain = schedule(twin, TP1)
    for i, (a, b, c) in enumerate(zip(got, expected, plain, strict=True)):
        assert torch.equal(a, b), f"forward {i}: max |FP8 - twin with rounding| {(a - b).abs().max():.3g}"
        assert (a - c).abs().max() > 1e-2, f"forward {i}: the activations were not rounded"
    with activation_rounding(lambda x, dtype: x.to(dtype)):   # no rounding: the twin, exactly
        for i, (a, c) in enumerate(zip(schedule(ours, TP1), plain, strict=True)):
            assert torch.equal(a, c), f"forward {i}"


# --------------------------------------------------------------------------------------------------
# Within a derived bound

RHO_HI = 2 ** -3 / math.sqrt(12)   # RMS relative rounding error where an FP8 step is 2^-3 of the value
RHO_LO = 2 ** -4 / math.sqrt(12)   # ... and where it is 2^-4
SIGMA = 1e-4


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_logits_within_the_bound_of_fp8_activation_rounding(checkpoints, family):
    """|FP8 - twin| over a forward schedule's logits, bounded by the FP8 rounding of the activations
    propagated through this model's own sensitivity (fp64, so that nothing else rounds).

    Rounding to float8_e4m3fn (3 mantissa bits, to nearest) moves a value x by e, |e| <= 2^-4 |x| (plus
    at most 2^-10 of its row's scale below FP8's normal range, 2^-6 * scale: negligible at 448 steps
    per row). The step is 2^-3 |x| at the bottom of a binade, 2^-4 |x| at its top; an error uniform over
    a step has RMS step / sqrt(12), so RMS(e / x) lies in [RHO_LO, RHO_HI] = [0.018, 0.036].

    To first order the logits move by D = sum_i g_i e_i over all rounded activations x_i (g_i: the
    logits' gradient in x_i), a sum of many independent zero-mean terms: E[D^2] = sum_i g_i^2 E[e_i^2],
    between RHO_LO^2 and RHO_HI^2 times S = sum_i g_i^2 x_i^2. S is measured on this model: with the
    rounding replaced by x_i (1 + SIGMA r_i), r_i = +-1 at random, the logits move by D_s with
    E[D_s^2] = SIGMA^2 S (SIGMA = 1e-4: second-order terms are 1e-4 of the first). Hence

        RHO_LO / SIGMA * rms(D_s)  <~  rms(FP8 - twin)  <~  RHO_HI / SIGMA * rms(D_s),

    and as both are linear images of independent per-activation errors through the same gradients, the
    largest |FP8 - twin| is as many RMS from zero as the largest |D_s|. Asserted as is for the RMS's
    upper bound (RHO_HI is the worst case: values spread over their binades give ~0.027), with 0.5 on
    the lower one and 1.5 on the largest error (sample fluctuation over a few thousand correlated
    logits, second-order terms). The lower bound fails if activations are not rounded, the upper one if
    they are rounded too coarsely (e5m2's 2 mantissa bits double the error). (A per-tensor scale slips
    through: e4m3's range spans these activations either way; the exact test above catches it.)

    DiffusionGemma's top-k routing is not continuous: the twin and the perturbed runs take the FP8 run's
    routing decisions (pinned_routing), so the bound is about the arithmetic, not about which experts a
    token happens to cross over to."""
    fp8_dir, twin_dir = checkpoints[family]
    ours = load_model(fp8_dir, dtype=torch.float64, show_progress=False)
    twin = load_model(twin_dir, dtype=torch.float64, show_progress=False)
    routing: list = []
    with pinned_routing(ours, routing, replay=False):
        fp8 = torch.cat(schedule(ours, TP1))
    with pinned_routing(twin, routing, replay=True):
        plain = torch.cat(schedule(twin, TP1))
    gen = torch.Generator().manual_seed(0)

    def perturbed(x, dtype):
        r = torch.randint(0, 2, x.shape, generator=gen).to(dtype) * 2 - 1
        return x.to(dtype) * (1 + SIGMA * r)

    with activation_rounding(perturbed), pinned_routing(ours, routing, replay=True):
        noisy = torch.cat(schedule(ours, TP1))
    d8, ds = fp8 - plain, noisy - plain

    def rms(t):
        return t.pow(2).mean().sqrt().item()

    lo, hi = RHO_LO / SIGMA * rms(ds), RHO_HI / SIGMA * rms(ds)
    assert 0.5 * lo <= rms(d8) <= hi, f"rms(FP8 - twin) {rms(d8):.4g} outside [{0.5 * lo:.4g}, {hi:.4g}]"
    bound = 1.5 * RHO_HI / SIGMA * ds.abs().max().item()
    assert d8.abs().max() <= bound, f"max |FP8 - twin| {d8.abs().max():.4g} > {bound:.4g}"
    assert plain.std() > 1.0 and rms(d8) > 1e-3   # logits large enough, rounding visible


# --------------------------------------------------------------------------------------------------
# Through the Engine

def prompt(seed: int, n: int, bos: int, low: int) -> list[int]:
    rng = random.Random(seed)
    return [bos] + [rng.randrange(low, 997) for _ in range(n - 1)]


def requests(family: str) -> tuple[list[list[int]], list[DecodeParams]]:
    if family == "nemotron":   # greedy in every mode
        prompts = [prompt(i, 5 + 7 * i, 1, 101) for i in range(4)]
        params = [DecodeParams(mode="ar", temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
                  DecodeParams(mode="diffusion", temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
                  DecodeParams(mode="diffusion", temperature=0, policy="low_confidence", max_tokens=33,
                               ignore_eos=True, logprobs=0),
                  DecodeParams(mode="linear_spec", max_tokens=24, ignore_eos=True, logprobs=2)]
    else:                      # DiffusionGemma always samples: seeded
        prompts = [prompt(i, 6 + 5 * i, 2, 10) for i in range(3)]
        params = [DecodeParams(seed=i, max_tokens=16 * (1 + i % 2), ignore_eos=True, logprobs=[None, 2][i % 2],
                               max_denoising_steps=4) for i in range(3)]
    return prompts, params


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_engine_serves_the_fp8_checkpoint_as_its_twin_with_compressed_tensors_rounding(checkpoints, family):
    """Same tokens and logprobs, exactly, from the FP8 checkpoint's Engine and the twin's Engine whose
    quantized layers round their inputs with compressed-tensors; the plain twin's logprobs differ."""
    fp8_dir, twin_dir = checkpoints[family]
    prompts, params = requests(family)
    with Engine(str(fp8_dir), num_slots=4, max_model_len=256) as engine:
        got = served.generate(engine, prompts, params)
    with Engine(str(twin_dir), num_slots=4, max_model_len=256) as engine:
        twin = engine.shards.runner.model
        with ct_activation_rounding(twin, fp8_modules(fp8_dir, twin)):
            expected = served.generate(engine, prompts, params)
        plain = served.generate(engine, prompts, params)
    for a, b in zip(got, expected, strict=True):
        assert a.output == b.output and len(a.output) == a.params.max_tokens, a.params
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs and a.top_ids == b.top_ids
    scored = [(a, c) for a, c in zip(got, plain) if a.logprobs]
    assert scored and any(a.logprobs[0] != c.logprobs[0] for a, c in scored)
