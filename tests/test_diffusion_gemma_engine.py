"""DiffusionGemma served by the same engine: generation against transformers' generate, the fixed
schedule of docs/spec.md 8, logprob isolation, TP=2 against TP=1."""
import random

import pytest
import torch

from model.sampling.params import DecodeParams, ParamError
from tests import served
from tests.reference import gemma_generate_with_our_draws
from workers.engine import Engine

V = 997


@pytest.fixture(scope="module")
def engine(tiny_gemma):
    with Engine(tiny_gemma, num_slots=6, max_model_len=256) as e:
        yield e


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(10, V) for _ in range(n - 1)]


def test_engine_generation_equals_transformers_generate(engine, tiny_gemma, monkeypatch):
    """Same weights, same draws (transformers' multinomial and canvas init replaced by our noise)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tiny_gemma, attn_implementation="eager").eval()
    knobs = dict(t_min=0.4, t_max=0.8, entropy_bound=0.5, stability_threshold=0, confidence_threshold=0.9)
    p, seed, steps, canvases = prompt(1, 20), 77, 6, 2
    ours = engine.generate([p], DecodeParams(seed=seed, max_tokens=canvases * 16, ignore_eos=True,
                                             max_denoising_steps=steps, **knobs))[0]
    expected, _ = gemma_generate_with_our_draws(ref, torch.tensor(p), torch.tensor([seed]), steps, canvases,
                                                knobs, monkeypatch)
    assert ours.output == expected
    assert ours.denoising_steps < canvases * steps  # convergence stopped canvases early


def test_fixed_schedule_commits_canvas_over_steps_tokens_per_step(tmp_path):
    """docs/spec.md 8: canvas_length 256, max_denoising_steps 16, confidence_threshold 0 -> exactly 16
    committed tokens per denoising step and 16 steps per canvas; no commit forward after the last."""
    from model.tiny import write_diffusion_gemma

    model_dir = write_diffusion_gemma(tmp_path / "c256", seed=1, canvas_length=256)
    with Engine(model_dir, num_slots=2, max_model_len=1024) as e:
        params = DecodeParams(seed=3, max_tokens=512, ignore_eos=True, max_denoising_steps=16,
                              confidence_threshold=0)
        requests = e.generate([prompt(2, 9), prompt(3, 30)], params)
        c = e.scheduler.counters
    assert all(len(r.output) == 512 and r.canvases == 2 and r.denoising_steps == 32 for r in requests)
    assert c.committed_tokens / c.denoising_steps == 16 and c.denoising_steps / c.canvases == 16
    # forwards: each request's prefill, its denoising steps, and one commit (its last canvas emits at once)
    assert c.forwards == 2 * (1 + 32 + 1)


def test_request_alone_equals_request_among_neighbours(engine):
    probe = (prompt(10, 12), DecodeParams(seed=5, max_tokens=40, ignore_eos=True, logprobs=3))
    alone = served.generate(engine, [probe[0]], [probe[1]])[0]
    neighbours = [(prompt(20 + i, 5 + 7 * i), DecodeParams(seed=i, max_tokens=10 + 9 * i, ignore_eos=True,
                                                          logprobs=[None, 0, 5][i % 3], top_k=[0, 40][i % 2],
                                                          max_denoising_steps=[None, 4][i % 2]))
                  for i in range(4)]
    batch = neighbours[:2] + [probe] + neighbours[2:]
    together = served.generate(engine, [p for p, _ in batch], [q for _, q in batch])[2]
    assert together.output == alone.output
    assert len(together.logprobs) == len(together.output) == 40
    assert max(abs(a - b) for a, b in zip(together.logprobs, alone.logprobs)) < 1e-4
    assert together.top_ids == alone.top_ids and all(r >= 1 for r in together.ranks)


def test_converged_step_scores_the_committed_argmax(engine):
    (r,) = served.generate(engine, [prompt(30, 8)], DecodeParams(seed=9, max_tokens=16, ignore_eos=True,
                                                                  logprobs=2))
    # the committed token is the argmax of the converged step's distribution: rank 1, the top alternative
    assert r.ranks == [1] * 16
    assert [ids[0] for ids in r.top_ids] == r.output
    assert all(abs(lp - top[0]) < 1e-6 for lp, top in zip(r.logprobs, r.top_logprobs))


def test_modes_other_than_diffusion_are_rejected_by_name(engine):
    with pytest.raises(ParamError, match="mode='ar'.*DiffusionGemma") as err:
        engine.add(prompt(1, 3), DecodeParams(mode="ar"))
    assert err.value.param == "diffusion.mode"


def test_tensor_parallel_engine_equals_tp1(engine, tiny_gemma):
    cases = [(prompt(40 + i, 6 + 5 * i), DecodeParams(seed=i, max_tokens=16 * (1 + i % 2), ignore_eos=True,
                                                    logprobs=[None, 2][i % 2], max_denoising_steps=4))
             for i in range(3)]
    ref = served.generate(engine, [p for p, _ in cases], [q for _, q in cases])
    with Engine(tiny_gemma, tp=2, num_slots=6, max_model_len=256) as tp2:
        got = served.generate(tp2, [p for p, _ in cases], [q for _, q in cases])
    for a, b in zip(ref, got):
        assert a.output == b.output
        if a.logprobs:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_temperature_scales_the_schedule_and_0_is_reproducible(engine):
    """temperature tau runs the schedule from tau t_max down to tau t_min; none, 1 and 0 run it as set, 0 with
    its noise from a fixed seed when the request gives none: the same request then gives the same tokens
    whatever ran before it and whatever runs beside it (fp32)."""
    p = prompt(5, 12)
    base = dict(max_tokens=32, ignore_eos=True, t_min=0.4, t_max=0.8)

    def out(**kw) -> list[int]:
        return engine.generate([p], DecodeParams(**base | kw))[0].output

    half = out(temperature=0.5, seed=7)
    assert half == out(t_min=0.2, t_max=0.4, seed=7)
    assert half != out(seed=7)
    assert out(seed=7) == out(temperature=1.0, seed=7) == out(temperature=0, seed=7)
    zero = out(temperature=0)
    assert out() != out()   # no seed, a temperature above 0: drawn anew each time
    assert zero == out(temperature=0) == out(seed=0)
    beside = engine.generate([prompt(6, 20), p, prompt(7, 9)], [
        DecodeParams(max_tokens=48, temperature=1.5, seed=1), DecodeParams(**base, temperature=0),
        DecodeParams(max_tokens=16, logprobs=3)])
    assert beside[1].output == zero
    with pytest.raises(ValueError, match="temperature"):   # both ends would round to one fp32 value
        DecodeParams(t_min=1e-40, t_max=2e-40, temperature=1e-5)
    # below MIN_TEMPERATURE a request is greedy: the schedule as set, the fixed seed
    assert out(temperature=1e-30) == zero
