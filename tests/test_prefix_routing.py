"""Routing that follows the prefix cache (workers/prefix_router.py): with two Coordinator replicas, 8
conversations of 4 turns each are served with a cache hit rate at least 0.9 of one replica's, through
Serve's request router and real HTTP; Serve's default router's rate is reported beside it. And the
router's own choices: a cold prompt's replica by rendezvous hashing, a warm one where its pages are,
an overloaded holder passed over."""
import asyncio
import random
import types
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deployments.app import build_app
from tests.inprocess import inprocess_app
from tests.serve_harness import serving
from workers.kv_pages import page_hashes
from workers.prefix_router import STATS_KEY, PrefixAffinityRouter, short

pytestmark = pytest.mark.shared_serve

CONVERSATIONS, TURNS = 8, 4


def converse(post, seed: int) -> tuple[int, int]:
    """CONVERSATIONS chats of TURNS turns each, the chats side by side, each turn resending the chat so
    far through `post` (a chat completions body -> the response's JSON): (prompt tokens, of them served
    from the cache), summed."""
    rng = random.Random(seed)
    system = {"role": "system", "content": "Answer as the documentation of Python's standard library does. " * 2}
    chats = [[system] for _ in range(CONVERSATIONS)]
    totals = [0, 0]

    def turn(chat: list[dict]) -> None:
        chat.append({"role": "user", "content": " ".join(rng.choice(["Return", "the", "list", "of", "items", "in"])
                                                         for _ in range(8))})
        r = post({"model": "tiny", "messages": chat, "max_completion_tokens": 32, "temperature": 0,
                  "ignore_eos": True})
        chat.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        totals[0] += r["usage"]["prompt_tokens"]
        totals[1] += r["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        for _ in range(TURNS):
            list(pool.map(turn, chats))
    return totals[0], totals[1]


@pytest.fixture(scope="module")
def rates(tiny_nemotron):
    """The hit rate on the same conversations of one replica (the app in this process: the same engine
    and cache, without Serve), of two replicas routed by prefix and of two under Serve's default router,
    both through Serve and real HTTP (deployed side by side, served one after the other)."""
    common = dict(served_model_name="tiny", max_model_len=1024, max_num_seqs=8)
    with inprocess_app(tiny_nemotron, **common) as app:
        prompts, cached = converse(lambda body: app.post("/v1/chat/completions", json=body, timeout=120).json(), 1)
    out = {"one": cached / prompts}
    two = {**common, "model": str(tiny_nemotron), "num_replicas": 2, "shard_cpus": 0.5}
    with serving({"routed": build_app(two), "default": build_app({**two, "prefix_routing": False})}) as port:
        for name in ("routed", "default"):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{name}/v1", api_key="x", max_retries=0,
                                   timeout=120)

            def post(body: dict, client=client) -> dict:
                extra = {"ignore_eos": body.pop("ignore_eos")}
                return client.chat.completions.create(**body, extra_body=extra).model_dump()

            prompts, cached = converse(post, seed=1)
            out[name] = cached / prompts
    print(f"\nprefix cache hit rate: one replica {out['one']:.3f}, two routed by prefix {out['routed']:.3f}, "
          f"two by Serve's default router {out['default']:.3f}")
    return out


def test_routing_by_prefix_keeps_the_hit_rate_of_one_replica(rates):
    assert rates["one"] > 0.5
    assert rates["routed"] >= 0.9 * rates["one"]


# ---- the router's choices, on stand-ins for Serve's replicas and pending requests ----------------------


ReplicaID = namedtuple("ReplicaID", "unique_id")   # hashable, as Serve's is


def replica(name: str, pages: list[int] = ()) -> types.SimpleNamespace:
    return types.SimpleNamespace(replica_id=ReplicaID(name), routing_stats={STATS_KEY: list(pages)})


def pending(prompt: list[int]) -> types.SimpleNamespace:
    return types.SimpleNamespace(args=(prompt, None, "id"), metadata=types.SimpleNamespace(call_method="generate"),
                                 routing_context=types.SimpleNamespace(should_backoff=False))


def router(queues: dict[str, int]) -> PrefixAffinityRouter:
    r = object.__new__(PrefixAffinityRouter)   # Serve builds it with its own state; the choices need only this
    r.initialize_state(page_size=16, salt="m", imbalance=2)
    r._replica_queue_len_cache = types.SimpleNamespace(get=lambda rid: queues[rid.unique_id])
    return r


def test_a_warm_prompt_goes_where_its_pages_are_unless_that_replica_is_overloaded():
    prompt = list(range(100))
    pages = [short(h) for h in page_hashes(prompt[:-1], 16, b"m")]
    a, b = replica("a", pages[:3]), replica("b", pages[:5])
    ranked = asyncio.run(router({"a": 0, "b": 2}).choose_replicas([a, b], pending(prompt)))
    assert ranked == [[b], [a]]                      # the longer cached prefix, within the imbalance
    ranked = asyncio.run(router({"a": 0, "b": 3}).choose_replicas([a, b], pending(prompt)))
    assert ranked[0] == [a]                          # past it: the less loaded holder
    ranked = asyncio.run(router({"a": 10, "b": 13}).choose_replicas([a, b], pending(prompt)))
    assert ranked == [[b], [a]]                      # past it, yet under 1.5 times the least: still b
    request = pending(prompt)
    asyncio.run(router({"a": 0, "b": 0}).choose_replicas([a, b], request))
    assert request.routing_context.should_backoff


def test_a_cold_prompt_goes_to_the_same_replica_from_every_router_and_cold_prompts_spread():
    replicas = [replica(n) for n in "abcd"]
    queues = dict.fromkeys("abcd", 0)
    prompts = [[7] + list(range(s, s + 40)) for s in range(0, 4000, 100)]
    first = [asyncio.run(router(queues).choose_replicas(replicas, pending(p)))[0][0] for p in prompts]
    again = [asyncio.run(router(queues).choose_replicas(replicas, pending(p)))[0][0] for p in prompts]
    assert first == again and len({r.replica_id.unique_id for r in first}) == 4


def test_a_prompt_sent_lately_counts_as_held_before_the_replicas_report_it():
    prompt = list(range(60))
    a, b = replica("a"), replica("b")
    r = router({"a": 0, "b": 0})
    cold = asyncio.run(r.choose_replicas([a, b], pending(prompt)))[0][0]
    r.on_request_routed(pending(prompt), cold.replica_id, None)
    longer = prompt + list(range(60, 90))        # its next turn: the same leading pages
    assert asyncio.run(r.choose_replicas([a, b], pending(longer)))[0][0] is cold


def test_other_calls_go_to_the_less_loaded_of_two():
    a, b = replica("a"), replica("b")
    call = types.SimpleNamespace(args=(), metadata=types.SimpleNamespace(call_method="stats"),
                                 routing_context=types.SimpleNamespace(should_backoff=False))
    assert asyncio.run(router({"a": 5, "b": 1}).choose_replicas([a, b], call)) == [[b, a]]
