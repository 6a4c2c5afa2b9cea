"""The engine end to end on a tiny checkpoint: batch invariance of tokens and reveal-time scores, AR
against transformers' generate, linear speculation against AR, TP=2 against TP=1."""
import random

import pytest
import torch

from model.sampling.params import DecodeParams
from tests import served
from tests.reference import hf_ministral3
from workers.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_nemotron):
    # no prefix caching: a probe run alone first would then be served from the cache in its batch, whose
    # KV rounds otherwise in fp32 (tests/test_prefix_cache.py holds cached against cold)
    with Engine(tiny_nemotron, num_slots=8, max_model_len=512, enable_prefix_caching=False) as e:
        yield e


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(101, 997) for _ in range(n - 1)]


def test_logprob_requests_do_not_change_neighbours(engine):
    """The regression behind this design: budgets 17, 41, 9 (canvas 32: the top-k neighbour finishes
    before the 41-token request's second block); batch A asks logprobs=0 everywhere, batch B None, 0, 2."""
    prompts = [prompt(1, 12), prompt(2, 7), prompt(3, 20)]
    budgets = [17, 41, 9]

    def run(logprobs):
        params = [DecodeParams(temperature=0, ignore_eos=True, max_tokens=b, logprobs=lp)
                  for b, lp in zip(budgets, logprobs)]
        return served.generate(engine, prompts, params)

    a, b = run([0, 0, 0]), run([None, 0, 2])
    for ra, rb, budget in zip(a, b, budgets):
        assert ra.output == rb.output and len(ra.output) == budget
    for r in a + [b[1], b[2]]:
        assert len(r.logprobs) == len(r.output) and all(lp <= 0 for lp in r.logprobs)
    for ra, rb in zip(a[1:], b[1:]):
        assert max(abs(x - y) for x, y in zip(ra.logprobs, rb.logprobs)) < 0.02
    assert not b[0].logprobs
    assert all(len(t) == 2 for t in b[2].top_logprobs)


def random_params(rng: random.Random) -> DecodeParams:
    mode = rng.choice(["diffusion", "diffusion", "ar", "linear_spec"])
    kwargs = dict(mode=mode, max_tokens=rng.randint(3, 70), ignore_eos=rng.random() < 0.7,
                  logprobs=rng.choice([None, 0, 1, 5]), seed=rng.randrange(1000))
    if mode != "linear_spec":
        kwargs |= dict(temperature=rng.choice([0, 0.7, 1.3]), top_k=rng.choice([0, 0, 5, 50]),
                       top_p=rng.choice([1.0, 1.0, 0.9]))
    if mode == "diffusion":
        kwargs |= dict(policy=rng.choice(["threshold", "low_confidence", "leftmost", "entropy_bound"]),
                       max_denoising_steps=rng.choice([None, 8, 16]), threshold=rng.choice([0.9, 0.5]),
                       entropy_bound=rng.choice([0.1, 1.0]))
    return DecodeParams(**kwargs)


def test_requests_alone_equal_requests_in_random_batches(engine):
    rng = random.Random(7)
    probes = [(prompt(100 + i, rng.randint(3, 40)), random_params(rng)) for i in range(5)]
    alone = [served.generate(engine, [p], [q])[0] for p, q in probes]
    for trial in range(2):
        neighbours = [(prompt(200 + 10 * trial + i, rng.randint(3, 60)), random_params(rng)) for i in range(3)]
        by_prompt = served.generate_shuffled(engine, probes + neighbours, rng)
        for (p, _), ref in zip(probes, alone):
            served.assert_same_answer(by_prompt[tuple(p)], ref)


def test_ar_greedy_equals_transformers_generate(engine, tiny_nemotron):
    ref = hf_ministral3(tiny_nemotron)
    prompts = [prompt(11, 9), prompt(12, 30), prompt(13, 4)]
    budgets = [20, 7, 33]
    ours = engine.generate(prompts, [DecodeParams(mode="ar", temperature=0, max_tokens=b, ignore_eos=True)
                                     for b in budgets])
    for p, b, r in zip(prompts, budgets, ours):
        with torch.no_grad():
            # the mask token is never predicted (docs/spec.md 3.1): suppress it in the reference too
            out = ref.generate(torch.tensor([p]), max_new_tokens=b, do_sample=False, min_new_tokens=b,
                               suppress_tokens=[100], pad_token_id=0)
        assert r.output == out[0, len(p):].tolist()


def test_linear_speculation_equals_ar_greedy(engine):
    prompts = [prompt(21, 5), prompt(22, 18), prompt(23, 33), prompt(24, 2)]
    budgets = [40, 13, 70, 1]
    ar = served.generate(engine, prompts, [DecodeParams(mode="ar", temperature=0, max_tokens=b, ignore_eos=True,
                                                        logprobs=1) for b in budgets])
    spec = served.generate(engine, prompts, [DecodeParams(mode="linear_spec", max_tokens=b, ignore_eos=True,
                                                          logprobs=1) for b in budgets])
    for a, s in zip(ar, spec):
        assert s.output == a.output
        assert max(abs(x - y) for x, y in zip(s.logprobs, a.logprobs)) < 1e-4
        assert s.top_ids == a.top_ids
    # and it did speculate: every request's tokens came from verify passes (a canvas each, one token at
    # least), where AR runs none (test_decode_logprobs checks blocks of more than one accepted token)
    assert all(a.canvases == 0 for a in ar)
    assert all(1 <= s.canvases <= len(s.output) for s in spec)


def test_a_temperature_below_the_minimum_is_greedy(engine):
    """Logits divided by a temperature below 1e-5 (e.g. 1e-30, nonzero in fp32) would overflow to inf and
    decode garbage (token 0 everywhere); below MIN_TEMPERATURE a request is greedy, as vLLM's is."""
    p = prompt(7, 12)
    assert DecodeParams(temperature=1e-30).effective_temperature == 0
    assert DecodeParams(temperature=2e-5).effective_temperature == 2e-5
    greedy, tiny = (served.generate(engine, [p], [DecodeParams(max_tokens=32, temperature=t, ignore_eos=True)])[0]
                    for t in (0, 1e-30))
    assert tiny.output == greedy.output and len(set(greedy.output)) > 1


def test_linear_speculation_rejects_temperature():
    with pytest.raises(ValueError, match="linear_spec.*temperature|temperature.*linear_spec"):
        DecodeParams(mode="linear_spec", temperature=0.5)


def test_tensor_parallel_engine_equals_tp1(engine, tiny_nemotron):
    rng = random.Random(5)
    cases = [(prompt(300 + i, rng.randint(3, 30)), random_params(rng)) for i in range(6)]
    ref = served.generate(engine, [p for p, _ in cases], [q for _, q in cases])
    with Engine(tiny_nemotron, tp=2, num_slots=8, max_model_len=512) as tp2:
        got = served.generate(tp2, [p for p, _ in cases], [q for _, q in cases])
    for (p, q), a, b in zip(cases, ref, got):
        assert a.output == b.output, q
        if q.logprobs is not None:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
            assert a.ranks == b.ranks and a.top_ids == b.top_ids
