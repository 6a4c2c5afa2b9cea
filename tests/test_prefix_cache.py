"""The prefix cache end to end on the in-process engine (workers/kv_pages.py, model/attention.py's pages):
a request served from the cache gives what it gives cold (tokens equal, scores within fp32 rounding), for
both families, greedy and sampled, beside cached and uncached neighbours, across a conversation's turns,
for choices of one prompt admitted together, at TP = 2, and under eviction; admission waits for pages,
and every page is free or cached once requests end."""
import random

import pytest

from model.sampling.params import DecodeParams, ParamError
from tests import served
from workers.engine import Engine

TOL = 1e-4   # fp32: the cached prefill sums its keys in another order than the cold one


def prompt(seed: int, n: int, vocab: int = 900) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(10, vocab) for _ in range(n - 1)]


PARAMS = {
    "nemotron": [DecodeParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                 DecodeParams(temperature=0.8, seed=5, max_tokens=33, logprobs=0, policy="low_confidence"),
                 DecodeParams(mode="ar", temperature=0, max_tokens=12, logprobs=1),
                 DecodeParams(mode="linear_spec", max_tokens=30, ignore_eos=True, logprobs=0)],
    "gemma": [DecodeParams(seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
              DecodeParams(temperature=0, max_tokens=20, logprobs=0, confidence_threshold=0)],
}


@pytest.fixture(scope="module", params=["nemotron", "gemma"])
def family(request, tiny_nemotron, tiny_gemma):
    return request.param, (tiny_nemotron if request.param == "nemotron" else tiny_gemma)


def engine(model_dir, caching: bool = True, **kw) -> Engine:
    return Engine(str(model_dir), num_slots=4, max_model_len=384, dtype="float32", enable_prefix_caching=caching, **kw)


def assert_same(got: served.Served, cold: served.Served) -> None:
    assert got.output == cold.output and got.finish_reason == cold.finish_reason
    assert (got.logprobs is None) == (cold.logprobs is None)
    if cold.logprobs is not None:
        assert max((abs(a - b) for a, b in zip(got.logprobs, cold.logprobs)), default=0) < TOL
        assert got.top_ids == cold.top_ids


def assert_no_page_held(e: Engine) -> None:
    """Every request ended: each page is free or cached, nothing reserved."""
    pages = e.scheduler.pages
    pages.check()
    assert not pages.requests and all(p.used == 0 for p in pages.pools) and pages.reserved == [0] * len(pages.pools)


def test_a_request_from_the_cache_gives_what_it_gives_cold(family):
    """Each request twice: cold, then with its prompt's full pages (but its last token's) from the cache;
    beside them, an engine that never caches."""
    name, model_dir = family
    prompts = [prompt(i, 20 + 13 * i) for i in range(len(PARAMS[name]))]
    with engine(model_dir, caching=False) as never:
        cold = served.generate(never, prompts, PARAMS[name])
    with engine(model_dir) as e:
        first = served.generate(e, prompts, PARAMS[name])
        again = served.generate(e, prompts, PARAMS[name])
        requests = [e.scheduler.pages.hits]
        assert_no_page_held(e)
    for f, a, c, p in zip(first, again, cold, prompts):
        assert_same(f, c)
        assert_same(a, c)
    assert requests[0] >= sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_cached_and_cold_neighbours_in_one_batch(family):
    """A batch of two requests whose prompts are cached and two whose prompts are not gives each what it
    gets alone and cold."""
    name, model_dir = family
    params = PARAMS[name][0]
    warm = [prompt(50, 40), prompt(51, 35)]
    fresh = [prompt(60, 38), prompt(61, 24)]
    with engine(model_dir, caching=False) as never:
        alone = [served.generate(never, [p], [params])[0] for p in warm + fresh]
    with engine(model_dir) as e:
        served.generate(e, warm, [DecodeParams(max_tokens=1)] * 2)   # their prompts' pages cached
        batch = served.generate(e, warm + fresh, [params] * 4)
        assert e.scheduler.pages.hits == 2 * 32   # the warm two's 2 pages each
        assert_no_page_held(e)
    for got, ref in zip(batch, alone):
        assert_same(got, ref)


def test_a_conversations_next_turn_reuses_the_committed_blocks(family):
    """Turn 2 sends turn 1's prompt, its answer and more: the answer's committed canvases are cached too,
    so more than the first prompt is served from the cache, and the turn gives what it gives cold."""
    name, model_dir = family
    params = DecodeParams(temperature=0, max_tokens=48, ignore_eos=True)
    turn1 = prompt(70, 30)
    with engine(model_dir) as e:
        answer = served.generate(e, [turn1], [params])[0].output
        turn2 = turn1 + answer + prompt(71, 12)[1:]
        before = e.scheduler.pages.hits
        got = served.generate(e, [turn2], [params])[0]
        cached = e.scheduler.pages.hits - before
    with engine(model_dir, caching=False) as never:
        cold = served.generate(never, [turn2], [params])[0]
    assert_same(got, cold)
    # the first turn's prompt and the answer's committed canvases (the last canvas is emitted without a
    # commit, so it has no KV), in whole pages
    canvas = 32 if name == "nemotron" else 16
    committed = len(turn1) + (len(answer) - 1) // canvas * canvas
    assert cached == committed // 16 * 16 > len(turn1)


def test_choices_of_one_prompt_admitted_together_share_its_pages(family):
    """Two requests with one prompt in one command: the second reads the pages the first writes in the
    same prefill, and both give what each gives alone and cold."""
    name, model_dir = family
    p = prompt(80, 45)
    params = [DecodeParams(seed=1, max_tokens=20, ignore_eos=True, logprobs=1),
              DecodeParams(seed=2, max_tokens=20, ignore_eos=True, logprobs=1)]
    with engine(model_dir, caching=False) as never:
        alone = [served.generate(never, [p], [q])[0] for q in params]
    with engine(model_dir) as e:
        both = served.generate(e, [p, p], params)
        assert e.scheduler.pages.hits == 32   # the second's: two of the prompt's pages
        assert_no_page_held(e)
    for got, ref in zip(both, alone):
        assert_same(got, ref)


def test_eviction_keeps_every_held_page_and_every_answer(family):
    """A pool of 60 pages and 8 distinct prompts of 3-5 pages, twice over: cached pages are evicted to
    admit new requests, never one a running request holds, and every answer is the cold one."""
    name, model_dir = family
    params = DecodeParams(temperature=0, max_tokens=16, logprobs=0)
    prompts = [prompt(90 + i, 50 + 9 * i) for i in range(8)]
    with engine(model_dir, caching=False) as never:
        cold = served.generate(never, prompts, [params] * 8)
    with engine(model_dir, kv_cache_tokens=60 * 16) as e:
        for _ in range(2):
            got = served.generate(e, prompts, [params] * 8)
            e.scheduler.pages.check()
            for g, c in zip(got, cold):
                assert_same(g, c)
        assert_no_page_held(e)
        assert e.scheduler.pages.pools[0].cached <= 60


def test_admission_waits_for_pages_and_refuses_what_can_never_fit(tiny_nemotron):
    """A pool of 6 pages: a request of 5 runs while another of 5 waits (not refused), then runs; one of 7
    pages is refused, naming max_tokens."""
    with engine(tiny_nemotron, kv_cache_tokens=6 * 16) as e:
        p = DecodeParams(temperature=0, max_tokens=32, ignore_eos=True)   # 17 + 32 + a canvas of scratch: 6 pages
        a, b = e.add(prompt(1, 17), p), e.add(prompt(2, 17), p)
        e.step()
        assert a.slot is not None and b.slot is None and e.scheduler.num_waiting == 1
        e.run([a, b])
        assert len(a.output) == len(b.output) == 32
        with pytest.raises(ParamError) as err:
            e.add(prompt(3, 60), p)
        assert err.value.param == "max_tokens" and "KV cache" in err.value.message
        assert_no_page_held(e)


def test_tensor_parallel_from_the_cache_equals_tp1_cold(tiny_nemotron):
    """TP = 2 over gloo, the second run from the cache: the tokens and scores of TP = 1 served cold."""
    params = [DecodeParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              DecodeParams(temperature=0.9, seed=3, max_tokens=24, logprobs=0)]
    prompts = [prompt(100, 40), prompt(101, 27)]
    with engine(tiny_nemotron, caching=False) as tp1:
        cold = served.generate(tp1, prompts, params)
    with engine(tiny_nemotron, tp=2) as tp2:
        served.generate(tp2, prompts, params)
        again = served.generate(tp2, prompts, params)
        assert tp2.scheduler.pages.hits == 32 + 16
    for got, ref in zip(again, cold):
        assert_same(got, ref)


def test_a_long_prompt_prefilled_in_chunks_gives_what_it_gives_whole(family):
    """Prompts prefilled 24 positions a command (a chunk of one, then of two) give each request what it
    gets prefilled whole, beside a request that decodes meanwhile, and a chunked prompt's pages are
    cached for the next request as its chunks are written."""
    name, model_dir = family
    params = [DecodeParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
              DecodeParams(seed=4, max_tokens=30, logprobs=0),
              DecodeParams(temperature=0, max_tokens=40, ignore_eos=True)]
    prompts = [prompt(120, 70), prompt(121, 55), prompt(122, 9)]
    with engine(model_dir, caching=False) as never:
        whole = [served.generate(never, [p], [q])[0] for p, q in zip(prompts, params)]
    with engine(model_dir, prefill_chunk=24) as e:
        commands = []
        execute = e.shards.execute
        e.shards.execute = lambda cmd: (commands.append(cmd), execute(cmd))[1]
        got = served.generate(e, prompts, params)
        chunks = [r for cmd in commands for r in cmd.prefill]
        assert max(r.end - r.start for r in chunks) <= 24 and len(chunks) >= 6
        # chunks ride in commands whose steps run the decoding request (a command in which nothing decodes
        # yet is its prefill alone)
        assert sum(len(cmd.prefill) > 0 and cmd.max_steps >= 1 for cmd in commands) >= 4
        assert all(cmd.max_steps >= 1 for cmd in commands if cmd.admit and not cmd.prefill)
        again = served.generate(e, prompts[:1], params[:1])[0]
        assert_no_page_held(e)
    for g, w in zip(got, whole):
        assert_same(g, w)
    assert_same(again, whole[0])


def test_a_short_prompt_behind_a_long_one_starts_before_the_long_one_is_prefilled(tiny_nemotron):
    """While a request waits for a slot, a long prompt mid-prefill takes at most half a command's prefill
    budget: a short request sent after it is admitted and answers before the long prompt's last chunk."""
    with engine(tiny_nemotron, caching=False, prefill_chunk=32) as e:
        commands = []
        execute = e.shards.execute
        e.shards.execute = lambda cmd: (commands.append(cmd), execute(cmd))[1]
        long = e.add(prompt(130, 300), DecodeParams(temperature=0, max_tokens=8, ignore_eos=True))
        e.step()   # its first chunk
        short = e.add(prompt(131, 10), DecodeParams(temperature=0, max_tokens=8, ignore_eos=True))
        while not short.finished:
            e.step()
        assert long.prefilled < len(long.prompt) and not long.finished
        assert max(r.end - r.start for cmd in commands for r in cmd.prefill) <= 32
        while not long.finished:
            e.step()
    with engine(tiny_nemotron, caching=False) as whole:
        alone = served.generate(whole, [prompt(130, 300), prompt(131, 10)],
                                [DecodeParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2)
    assert [long.output, short.output] == [a.output for a in alone]
