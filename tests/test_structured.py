"""Structured output on the engine (docs/spec.md 12): every output that stops parses and validates (the
`jsonschema` library for JSON, Python's `re` for regexes), every output cut at max_tokens is a prefix the
grammar takes (a fresh llguidance matcher), in every reveal policy, in AR mode and in linear speculation (which
gives constrained AR greedy's tokens), many seeds each, on the tiny
random-weight model, which left alone writes noise, so every valid output is the constraint's doing; the
unconstrained neighbours of constrained requests keep their tokens and logprobs; TP = 2 gives TP = 1's tokens;
a grammar that lets text through keeps the canvas revealing several tokens a step."""
import json
import random
import re
from pathlib import Path

import jsonschema
import llguidance
import pytest

from model.checkpoint import Checkpoint
from model.grammar.compile import GrammarRequest, check_grammar
from model.grammar.tokenizer import grammar_tokenizer
from model.sampling.params import DecodeParams, Grammar, ParamError
from tests import served
from workers.engine import Engine

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "n", "ok"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{2,4}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/ | "x"'
SEEDS = range(6)
MODES = [("diffusion", "threshold"), ("diffusion", "low_confidence"), ("diffusion", "leftmost"),
         ("diffusion", "entropy_bound"), ("ar", "threshold")]


@pytest.fixture(scope="module")
def engine(tiny_nemotron):
    with Engine(tiny_nemotron, num_slots=8, max_model_len=512, enable_prefix_caching=False) as e:
        yield e


def tokenizers_of(model_dir):
    """The checkpoint's tokenizer, and llguidance's over it."""
    from transformers import AutoTokenizer

    cfg = Checkpoint.read(str(model_dir)).config
    return AutoTokenizer.from_pretrained(model_dir), grammar_tokenizer(model_dir, cfg.vocab_size, cfg.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizers(tiny_nemotron):
    return tokenizers_of(tiny_nemotron)


@pytest.fixture(scope="module")
def gemma(tiny_gemma):
    """DiffusionGemma's engine (canvas 16) and tokenizers."""
    with Engine(tiny_gemma, num_slots=8, max_model_len=256, enable_prefix_caching=False) as e:
        yield e, tokenizers_of(tiny_gemma)


def grammar(tokenizers, kind: str, value) -> Grammar:
    return Grammar(text=check_grammar(GrammarRequest(kind, value, "response_format"), tokenizers[1]))


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(101, 997) for _ in range(n - 1)]


def check(r: served.Served, g: Grammar, tokenizers, valid) -> str:
    """The output's text where it stopped (the grammar complete, `valid` holds of it), or the prefix cut at
    max_tokens; the grammar takes every token either way."""
    hf, llt = tokenizers
    matcher = llguidance.LLMatcher(llt, g.text)
    assert matcher.validate_tokens(r.output) == len(r.output), (r.finish_reason, r.output)
    if r.finish_reason == "stop":
        assert r.output[-1] in llt.eos_tokens
        text = hf.decode(r.output[:-1])
        valid(text)
        return text
    assert r.finish_reason == "length" and len(r.output) == r.params.max_tokens
    return hf.decode(r.output)


def json_valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("mode, policy", MODES, ids=[f"{m}-{p}" for m, p in MODES])
def test_json_schema_outputs_validate(engine, tokenizers, mode, policy):
    g = grammar(tokenizers, "json_schema", SCHEMA)
    params = [DecodeParams(mode=mode, policy=policy, temperature=1.0, seed=s, max_tokens=64, grammar=g)
              for s in SEEDS]
    done = served.generate(engine, [prompt(s) for s in SEEDS], params)
    stopped = [check(r, g, tokenizers, json_valid) for r in done if r.finish_reason == "stop"]
    for r in done:
        check(r, g, tokenizers, json_valid)
    assert len(stopped) >= len(SEEDS) // 2, [r.finish_reason for r in done]


# (kind, value, what a stopped text satisfies, whether most outputs stop: an open-ended grammar, such as any
# JSON object, lets the noise-writing model go on to max_tokens, where the output is a valid prefix)
@pytest.mark.parametrize("kind, value, valid, bounded", [
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text), True),
    ("choice", CHOICES, lambda text: text in CHOICES or pytest.fail(text), True),
    ("grammar", LARK, lambda text: re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text) or pytest.fail(text), True),
    ("grammar", 'root ::= "<" [a-c] [a-c]? ">"', lambda text: re.fullmatch(r"<[a-c]{1,2}>", text) or pytest.fail(text),
     True),
    ("json_object", None, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text), False),
], ids=["regex", "choice", "lark", "gbnf", "json_object"])
def test_every_kind_of_constraint_holds(engine, tokenizers, kind, value, valid, bounded):
    g = grammar(tokenizers, kind, value)
    params = [DecodeParams(mode=mode, policy=policy, temperature=1.0, seed=s, max_tokens=40, grammar=g)
              for s in SEEDS for mode, policy in MODES[::2]]
    done = served.generate(engine, [prompt(100 + i) for i in range(len(params))], params)
    for r in done:
        check(r, g, tokenizers, valid)
    assert sum(r.finish_reason == "stop" for r in done) >= (len(done) // 2 if bounded else 1)


def test_an_output_cut_at_max_tokens_is_a_valid_prefix(engine, tokenizers):
    g = grammar(tokenizers, "regex", "[a-z]{30,40}")
    done = served.generate(engine, [prompt(7), prompt(8), prompt(9)], [
        DecodeParams(mode="diffusion", temperature=1.0, seed=1, max_tokens=5, grammar=g),
        DecodeParams(mode="ar", temperature=1.0, seed=1, max_tokens=9, grammar=g),
        DecodeParams(mode="linear_spec", max_tokens=7, grammar=g)])
    for r in done:
        assert r.finish_reason == "length"
        assert re.fullmatch("[a-z]*", check(r, g, tokenizers, None))


@pytest.mark.parametrize("mode", ["diffusion", "ar", "linear_spec"])
def test_ignore_eos_after_a_complete_text_writes_only_eos(engine, tokenizers, mode):
    g = grammar(tokenizers, "choice", CHOICES)
    temperature = 0 if mode == "linear_spec" else 1.0   # linear speculation is greedy
    [r] = served.generate(engine, [prompt(9)], [DecodeParams(mode=mode, temperature=temperature, seed=3, max_tokens=40,
                                                              ignore_eos=True, grammar=g)])
    hf, llt = tokenizers
    assert len(r.output) == 40 and r.finish_reason == "length"
    end = next(i for i, x in enumerate(r.output) if x in llt.eos_tokens)
    assert hf.decode(r.output[:end]) in CHOICES and all(x in llt.eos_tokens for x in r.output[end:])


def test_constrained_logprobs_are_the_masked_renormalised_distribution(engine, tokenizers, monkeypatch):
    """docs/spec.md 12: an AR token of a constrained request is scored by the model's distribution masked to
    what its grammar allows (llguidance's mask of the text so far, computed here apart) and renormalised."""
    import numpy as np
    import torch
    from llguidance.numpy import fill_next_token_bitmask

    hf, llt = tokenizers
    g = grammar(tokenizers, "regex", REGEX)
    env = engine.shards.runner.env
    raw, constrain = [], env._constrain

    def spy(x, idx, spans):   # each causal pass's logits before the grammar limits them
        raw.append(x[0, -1].float().clone())
        constrain(x, idx, spans)

    monkeypatch.setattr(env, "_constrain", spy)
    [r] = served.generate(engine, [prompt(21)], [DecodeParams(mode="ar", temperature=1.0, seed=7, max_tokens=12,
                                                              logprobs=0, grammar=g)])
    monkeypatch.undo()
    assert r.finish_reason == "stop" and len(raw) >= len(r.output)
    matcher = llguidance.LLMatcher(llt, g.text)
    bits = np.zeros((1, (llt.vocab_size + 31) // 32), dtype=np.int32)
    renormalised = 0
    for i, token in enumerate(r.output):
        fill_next_token_bitmask(matcher, bits, 0)
        # the bits unpacked here, not by model/steps/env.allowed_ids: apart from the code under test
        ids = torch.arange(raw[i].shape[0])
        allowed = ((torch.from_numpy(bits[0]).long()[ids >> 5] >> (ids & 31)) & 1).bool()
        x = raw[i]
        expected = x[token] - torch.logsumexp(x[allowed], -1)
        assert allowed[token] and r.logprobs[i] == pytest.approx(expected.item(), abs=1e-5), i
        renormalised += expected.item() > torch.log_softmax(x, -1)[token].item() + 1e-3
        matcher.consume_token(token)
    assert renormalised >= len(r.output) // 2   # the mask mattered: the scores are not the model's own


def test_a_constrained_request_from_the_prefix_cache_gives_what_it_gives_cold(tiny_nemotron, tokenizers):
    """The grammar follows the output, the cache only the prompt: served twice from an engine that caches
    (the second time its prompt's pages from the cache), a constrained request gives its cold answer."""
    g = grammar(tokenizers, "json_schema", SCHEMA)
    prompts = [prompt(40 + i, 40) for i in range(3)]
    params = [DecodeParams(mode=m, policy=p, temperature=0 if m == "linear_spec" else 1.0, seed=i, max_tokens=48,
                           logprobs=1, grammar=g)
              for i, (m, p) in enumerate([("diffusion", "threshold"), ("ar", "threshold"), ("linear_spec", "threshold")])]
    with Engine(tiny_nemotron, num_slots=8, max_model_len=512) as e:
        first = served.generate(e, prompts, params)
        again = served.generate(e, prompts, params)
        assert e.scheduler.pages.hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    for f, a in zip(first, again):
        check(a, g, tokenizers, json_valid if a.finish_reason == "stop" else None)
        served.assert_same_answer(a, f)


def probe_params(rng: random.Random) -> DecodeParams:
    mode = rng.choice(["diffusion", "ar"])
    return DecodeParams(mode=mode, temperature=rng.choice([0, 1.0]), seed=rng.randrange(1000), max_tokens=rng.randint(9, 60),
                        logprobs=rng.choice([0, 2]), ignore_eos=True,
                        policy=rng.choice(["threshold", "entropy_bound", "leftmost"]))


def test_neighbours_of_constrained_requests_keep_their_tokens_and_logprobs(engine, tokenizers):
    """Batch isolation: unconstrained probes alone and beside constrained requests give the same tokens and
    scores; constrained probes (diffusion, linear speculation) too."""
    rng = random.Random(3)
    g = grammar(tokenizers, "json_schema", SCHEMA)
    probes = [(prompt(300 + i, rng.randint(3, 30)), probe_params(rng)) for i in range(4)]
    probes.append((prompt(310), DecodeParams(temperature=1.0, seed=5, max_tokens=48, logprobs=1, grammar=g)))
    # and a constrained verify, limited at several draft positions in an eager step beside graphed rows' plans
    probes.append((prompt(311), DecodeParams(mode="linear_spec", max_tokens=48, logprobs=1, grammar=g)))
    alone = [served.generate(engine, [p], [q])[0] for p, q in probes]
    neighbours = [(prompt(400 + i), DecodeParams(mode=m, policy=pol, temperature=1.0, seed=i, max_tokens=48,
                                                 grammar=g)) for i, (m, pol) in enumerate(MODES[:3])]
    neighbours.append((prompt(403), DecodeParams(mode="linear_spec", max_tokens=48, grammar=g)))
    by_prompt = served.generate_shuffled(engine, probes + neighbours, rng)
    for (p, q), ref in zip(probes, alone):
        assert q.logprobs is not None   # every probe is scored
        served.assert_same_answer(by_prompt[tuple(p)], ref)


def test_tensor_parallel_constrained_equals_tp1(engine, tiny_nemotron, tokenizers):
    g = grammar(tokenizers, "json_schema", SCHEMA)
    prompts = [prompt(500 + i) for i in range(3)]
    params = [DecodeParams(mode=m, policy=p, temperature=1.0, seed=i, max_tokens=48, logprobs=0, grammar=g)
              for i, (m, p) in enumerate([MODES[0], MODES[3], MODES[4]])]
    params.append(DecodeParams(mode="linear_spec", max_tokens=48, logprobs=0, grammar=g))
    prompts.append(prompt(503))
    assert_tp2_equals_tp1(engine, tiny_nemotron, 512, prompts, params, tol=1e-3)


def assert_tp2_equals_tp1(engine: Engine, model_dir, max_model_len: int, prompts, params, tol: float) -> None:
    """The requests on `engine` (TP = 1) and on a TP = 2 engine of the same checkpoint: the same tokens and
    finish, their logprobs within `tol`."""
    tp1 = served.generate(engine, prompts, params)
    with Engine(model_dir, tp=2, num_slots=8, max_model_len=max_model_len, enable_prefix_caching=False) as e:
        tp2 = served.generate(e, prompts, params)
    for a, b in zip(tp1, tp2):
        assert a.output == b.output and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tol


DEFAULT_DIR = Path(__file__).resolve().parents[1] / "model" / "checkpoints" / "tiny-docstrings"


def test_a_permissive_grammar_keeps_parallel_reveals():
    """The default model writes docstring words; a regex that lets most text through (no brackets, at least
    300 characters) leaves a canvas of 8 steps revealing several tokens a step, where revealing only the
    frontier would give one (docs/spec.md 12)."""
    from transformers import AutoTokenizer

    cfg = Checkpoint.read(str(DEFAULT_DIR)).config
    llt = grammar_tokenizer(DEFAULT_DIR, cfg.vocab_size, cfg.eos_token_ids)
    g = Grammar(text=check_grammar(GrammarRequest("regex", r"[^<>\[\]]{300,600}", "response_format"), llt))
    hf = AutoTokenizer.from_pretrained(DEFAULT_DIR)
    ids = hf.encode("Return the number of items in the")
    params = DecodeParams(temperature=0, max_tokens=64, policy="low_confidence", max_denoising_steps=8, grammar=g)
    with Engine(str(DEFAULT_DIR), num_slots=2, max_model_len=512) as e:
        [bound] = served.generate(e, [ids], [params])
    assert bound.finish_reason == "length" and re.fullmatch(r"[^<>\[\]]*", hf.decode(bound.output))
    assert len(bound.output) / bound.denoising_steps >= 2


@pytest.mark.parametrize("kind, value, valid", [
    ("json_schema", SCHEMA, json_valid),
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    ("grammar", LARK, lambda text: re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text) or pytest.fail(text)),
], ids=["json_schema", "regex", "lark"])
def test_linear_speculation_is_constrained_ar_greedy(engine, tokenizers, kind, value, valid):
    """Linear speculation under a grammar gives AR greedy's tokens under it (each accepted token and each seed
    is a causal prediction limited as an AR step's is), with its logprobs, and they validate."""
    g = grammar(tokenizers, kind, value)
    prompts = [prompt(600 + s) for s in SEEDS]
    spec = served.generate(engine, prompts, [DecodeParams(mode="linear_spec", max_tokens=48, logprobs=1, grammar=g)
                                             for _ in SEEDS])
    ar = served.generate(engine, prompts, [DecodeParams(mode="ar", temperature=0, max_tokens=48, logprobs=1,
                                                        grammar=g) for _ in SEEDS])
    for a, b in zip(spec, ar):
        check(a, g, tokenizers, valid)
        assert a.output == b.output and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("value", [r"(hello world, ){3}the end", r"(abc-){8}"])
def test_a_speculative_verify_limits_every_draft_position(engine, tokenizers, value):
    """A grammar that leaves few tokens at each position makes the draft's limited position 1 agree with the
    verify's limited prediction at 0, so verifies accept several tokens and the next seed is a prediction
    past position 0: unless the verify limits every position of the draft, the text leaves the grammar
    (and constrained AR greedy's tokens) at once."""
    g = grammar(tokenizers, "regex", value)
    prompts = [prompt(700 + s) for s in SEEDS]
    spec = served.generate(engine, prompts, [DecodeParams(mode="linear_spec", max_tokens=48, grammar=g)] * len(SEEDS))
    ar = served.generate(engine, prompts, [DecodeParams(mode="ar", temperature=0, max_tokens=48, grammar=g)]
                         * len(SEEDS))
    for a, b in zip(spec, ar):
        assert check(a, g, tokenizers, lambda text: re.fullmatch(value, text) or pytest.fail(text)) is not None
        assert a.output == b.output and a.finish_reason == "stop"
    per_verify = sum(len(r.output) for r in spec) / sum(r.denoising_steps for r in spec)
    assert per_verify >= 1.5, per_verify


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_a_constrained_canvas_takes_at_most_n_plus_c_steps(engine, gemma, tokenizers, family):
    """docs/spec.md 12: a refused token is masked again (masked diffusion) or the canvas may not converge
    yet (uniform noise, until its run is pinned from step N on), so a constrained canvas may take more than
    its N steps, at most N + C; on the tiny random models some do take more."""
    e, toks = (engine, tokenizers) if family == "nemotron" else gemma
    C, N = e.shards.runner.C, 4
    g = grammar(toks, "json_schema", SCHEMA)
    done = served.generate(e, [prompt(900 + s) for s in SEEDS], [
        DecodeParams(temperature=1.0, seed=s, max_tokens=3 * C, max_denoising_steps=N, grammar=g) for s in SEEDS])
    over = 0
    for r in done:
        check(r, g, toks, json_valid if r.finish_reason == "stop" else None)
        canvases = -(-len(r.output) // C)
        assert r.denoising_steps <= canvases * (N + C), (r.denoising_steps, canvases)
        over += r.denoising_steps > canvases * N
    assert over, "no canvas needed more than its N steps: the bound was not exercised"


def test_a_complete_grammar_takes_only_eos_after_it(tokenizers):
    """llguidance's matcher, once its grammar takes nothing more, validates no EOS itself (its mask still
    allows it): the slot's check must, or a canvas that starts after the text ends would never commit."""
    from model.grammar.guide import SlotGrammar

    hf, llt = tokenizers
    g = grammar(tokenizers, "choice", CHOICES)
    slot = SlotGrammar(llguidance.LLMatcher(llt, g.text), frozenset(llt.eos_tokens), ignore_eos=False, words=1)
    slot.commit(hf.encode("green", add_special_tokens=False))
    eos = llt.eos_tokens[0]
    assert slot.matcher.is_stopped() and slot.valid_prefix([eos, eos, 300]) == 2
    assert slot.valid_prefix([300, eos]) == 0


# ---- DiffusionGemma: uniform-noise canvases of 16 ------------------------------------------------------------
@pytest.mark.parametrize("kind, value, valid", [
    ("json_schema", SCHEMA, json_valid),
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    ("choice", CHOICES, lambda text: text in CHOICES or pytest.fail(text)),
], ids=["json_schema", "regex", "choice"])
def test_diffusion_gemma_outputs_validate(gemma, kind, value, valid):
    """Seeds whose text ends within a canvas, at its last position, or past it (the next canvas then holds
    only what follows, EOS included) all validate."""
    engine, toks = gemma
    g = grammar(toks, kind, value)
    params = [DecodeParams(temperature=1.0, seed=s, max_tokens=48, grammar=g) for s in range(8)]
    done = served.generate(engine, [[2, 50 + s, 60, 70] for s in range(8)], params)
    for r in done:
        check(r, g, toks, valid)
    assert sum(r.finish_reason == "stop" for r in done) >= 6


def test_diffusion_gemma_neighbours_keep_their_tokens_and_logprobs(gemma):
    engine, toks = gemma
    g = grammar(toks, "json_schema", SCHEMA)
    probes = [([2, 9, 8, 7], DecodeParams(temperature=1.0, seed=4, max_tokens=32, logprobs=1, ignore_eos=True)),
              ([2, 5, 5], DecodeParams(seed=6, max_tokens=16, logprobs=0, ignore_eos=True, max_denoising_steps=6))]
    alone = [served.generate(engine, [p], [q])[0] for p, q in probes]
    bound = [([2, 40 + i], DecodeParams(temperature=1.0, seed=i, max_tokens=48, grammar=g)) for i in range(3)]
    batch = probes + bound
    done = served.generate(engine, [p for p, _ in batch], [q for _, q in batch])
    for ref, got in zip(alone, done):
        assert got.output == ref.output
        assert max(abs(x - y) for x, y in zip(got.logprobs, ref.logprobs)) < 1e-4
    for r in done[2:]:
        check(r, g, toks, json_valid)


def test_diffusion_gemma_tensor_parallel_constrained_equals_tp1(gemma, tiny_gemma):
    engine, toks = gemma
    g = grammar(toks, "json_schema", SCHEMA)
    params = [DecodeParams(temperature=1.0, seed=i, max_tokens=48, logprobs=0, grammar=g) for i in range(2)]
    # these canvases run 20-40 self-conditioned steps, each feeding TP's fp32 rounding (bounded per step by
    # tests/tp_harness.py) into the next: their scores drift by ~1e-3, the tokens do not move
    assert_tp2_equals_tp1(engine, tiny_gemma, 256, [[2, 70, 71], [2, 80]], params, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_cuda_graphs_constrain_and_keep_the_neighbours_bits(family, tiny_nemotron, tiny_gemma):
    """On CUDA, in the graphs the server replays, under batch_invariant: constrained outputs validate, and an
    unconstrained request beside constrained ones keeps its bits (tokens and logprobs) of running alone."""
    model_dir, bos, modes = (tiny_nemotron, 1, MODES) if family == "nemotron" else (tiny_gemma, 2, MODES[:1])
    toks = tokenizers_of(model_dir)
    g = grammar(toks, "json_schema", SCHEMA)
    probe = ([bos, 600, 601], DecodeParams(temperature=1.0, seed=2, max_tokens=32, logprobs=2, ignore_eos=True))
    bound = [([bos, 610 + i], DecodeParams(mode=m, policy=p, temperature=1.0, seed=i, max_tokens=48, grammar=g))
             for i, (m, p) in enumerate(modes * 2)]
    if family == "nemotron":   # and a verify limited at every draft position
        bound.append(([bos, 620], DecodeParams(mode="linear_spec", max_tokens=48, grammar=g)))
    with Engine(model_dir, num_slots=8, max_model_len=256, device="cuda", dtype="bfloat16", batch_invariant=True,
                enable_prefix_caching=False) as e:
        [alone] = served.generate(e, [probe[0]], [probe[1]])
        done = served.generate(e, [probe[0]] + [p for p, _ in bound], [probe[1]] + [q for _, q in bound])
        assert e.shards.runner.graphs.captured > 0   # the steps ran as graphs (captured on first use)
    assert done[0].output == alone.output and done[0].logprobs == alone.logprobs
    assert done[0].top_logprobs == alone.top_logprobs
    for r in done[1:]:
        check(r, g, toks, json_valid)



def test_the_ingress_compiles_off_the_loop_within_a_bound_and_caches(tiny_nemotron, monkeypatch):
    """deployments/structured.py: a grammar is checked once per value (the second request is a dict lookup,
    errors too), and one that takes longer than the bound is a 400 naming its field, the loop answering
    meanwhile."""
    import asyncio
    import time

    from deployments import structured

    calls = []

    def slow_check(req, tokenizer):
        calls.append(req.kind)
        if req.kind == "regex":
            time.sleep(0.5)
        return check_grammar(req, tokenizer)

    monkeypatch.setattr(structured, "check_grammar", slow_check)
    compiler = structured.GrammarCompiler(Checkpoint.read(str(tiny_nemotron)), timeout_s=0.2)

    async def scenario():
        g1 = await compiler.compile(GrammarRequest("json_schema", SCHEMA, "response_format"))
        g2 = await compiler.compile(GrammarRequest("json_schema", dict(reversed(SCHEMA.items())), "response_format"))
        assert g1 == g2 and calls == ["json_schema"]
        for _ in range(2):
            with pytest.raises(ParamError) as err:
                await compiler.compile(GrammarRequest("json_schema", {"type": "strin"}, "structured_outputs.json"))
            assert err.value.param == "structured_outputs.json"
        assert calls == ["json_schema", "json_schema"]
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(ParamError) as err:
            await compiler.compile(GrammarRequest("regex", "a+", "structured_outputs.regex"))
        ticker.cancel()
        assert err.value.param == "structured_outputs.regex" and "took over 0.2 s" in err.value.message
        assert ticks >= 5   # the event loop ran while the grammar compiled

    asyncio.run(scenario())
