"""Load over real HTTP: bursts far beyond the slots and the queue are each answered (200, or 429/503 with
Retry-After), none dropped or hung; streams the client abandons mid-way free their slots; and the
server answers exactly as before afterwards. The 256-way burst is marked `reliability`."""
import asyncio
import json
import time

import httpx
import pytest

from benchmarks.http_checks import abandon_stream, assert_refused, burst
from deployments.app import build_app
from tests.serve_harness import (completions_url, greedy_choice, health, idle_and_healthy, serving, slow_stream_body,
                                 stats, wait_until)

pytestmark = pytest.mark.shared_serve

APP, MODEL = "load", "tiny"
NUM_SLOTS, MAX_QUEUE = 4, 4
REQUEST_BOUND_S = 120.0
PROBE = {"model": MODEL, "prompt": "unaffected", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
         "logprobs": 2}


@pytest.fixture(scope="module")
def server(tiny_nemotron):
    args = dict(model=str(tiny_nemotron), served_model_name=MODEL, max_num_seqs=NUM_SLOTS, max_queue=MAX_QUEUE,
                max_model_len=512, max_steps_per_command=8)
    # one app for the module (a second one, fresh for test_loop_outlives_..., cost ~10 s of deploy on 2
    # cores): that test runs first, before any request has reached it
    with serving({APP: build_app(args)}) as port:
        yield port


def url(port: int, app: str = APP) -> str:
    return completions_url(port, app)


def probe(port: int) -> dict:
    return greedy_choice(port, APP, PROBE)


@pytest.fixture(scope="module")
def before(server) -> dict:
    return probe(server)


def assert_unaffected(port: int, before: dict) -> None:
    """Idle with every slot free (within 30 s), no shard failure, and the probe's answer unchanged."""
    wait_until(lambda: idle_and_healthy(port, APP), 30, "every slot to be free and the server healthy")
    assert health(port, APP).json()["shard_failures"] == 0
    after = probe(port)
    assert after["text"] == before["text"]
    assert after["logprobs"]["token_logprobs"] == pytest.approx(before["logprobs"]["token_logprobs"], abs=1e-4)


# ---- the step loop (first: it needs an app no request has reached) -----------------------------

def test_loop_outlives_the_request_that_started_it(server):
    """The step loop starts inside the first request. Its client hanging up must not end the loop: a
    request running beside it still finishes, and no new request is needed to get it going again. First
    in the module: the app has served no request yet."""
    assert not any(stats(APP)["counters"].values()), "the app has served requests: its loop is not fresh"

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url(server), json=slow_stream_body(MODEL, 320)) as first:
                lines = first.aiter_lines()  # held open: leaving an async for would close the stream
                while not (await anext(lines)).startswith("data: {"):
                    pass
                other = asyncio.create_task(http.post(url(server),
                                                      json=dict(slow_stream_body(MODEL, 160), stream=False)))
                await asyncio.to_thread(wait_until, lambda: stats(APP)["running"] == 2, 30, "both to run")
                await first.aclose()  # the first request's client hangs up; the other must still finish
            return await asyncio.wait_for(other, 60)

    r = asyncio.run(scenario())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 160


# ---- overload ------------------------------------------------------------------------------------

async def _burst(port: int, n: int) -> list[dict]:
    """n requests at once: every other one streamed."""
    return await burst(url(port), [slow_stream_body(MODEL, 96, stream=i % 2 == 0) for i in range(n)], REQUEST_BOUND_S)


def check_burst(results: list[dict]) -> dict:
    codes = [r["status"] for r in results]
    assert set(codes) <= {200, 429, 503}, codes
    for r in results:
        if r["status"] != 200:
            error = assert_refused(r)
            assert error["type"] in ("rate_limit_exceeded", "service_unavailable")
        elif r["stream"]:
            assert r["payloads"][-1] == "[DONE]" and not any('"error"' in p for p in r["payloads"]), r
            chunks = [json.loads(p) for p in r["payloads"][:-1]]
            assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= 1
        else:
            assert r["body"]["usage"]["completion_tokens"] == 96
        assert r["s"] < REQUEST_BOUND_S
    # every request admitted to a slot or the queue was served: at least that many 200s
    assert codes.count(200) >= NUM_SLOTS + MAX_QUEUE and codes.count(429) >= 1
    return {c: codes.count(c) for c in sorted(set(codes))}


@pytest.mark.parametrize("n", [pytest.param(12, id="12"), pytest.param(256, id="256", marks=pytest.mark.reliability)])
def test_burst_beyond_the_queue_is_answered_never_dropped(server, before, n):
    t0 = time.monotonic()
    counts = check_burst(asyncio.run(_burst(server, n)))
    print(f"\n{n} concurrent requests against {NUM_SLOTS} slots + a queue of {MAX_QUEUE}: {counts} "
          f"in {time.monotonic() - t0:.1f} s; none dropped or hung")
    assert_unaffected(server, before)


# ---- disconnects ---------------------------------------------------------------------------------

async def _abandon_whole(port: int) -> bool:
    """A non-streamed slow completion whose client gives up after 0.5 s; True if it did give up."""
    async with httpx.AsyncClient(timeout=0.5) as http:
        try:
            await http.post(url(port), json=dict(slow_stream_body(MODEL, 320), stream=False))
        except httpx.TimeoutException:
            return True
    return False


async def _disconnects(port: int, streams: int, wholes: int) -> tuple[list[int], list[bool]]:
    gate = asyncio.Semaphore(NUM_SLOTS)  # at most a slot's worth at once: none is turned away with a 429

    async def stream(i):
        async with gate:
            return await abandon_stream(http, url(port), slow_stream_body(MODEL, 320), 1 + i % 3)

    async def whole():
        async with gate:
            return await _abandon_whole(port)

    async with httpx.AsyncClient(timeout=60) as http:
        jobs = [stream(i) for i in range(streams)] + [whole() for _ in range(wholes)]
        results = await asyncio.wait_for(asyncio.gather(*jobs), 600)
    return results[:streams], results[streams:]


def test_abandoned_requests_free_their_slots(server, before):
    """100 streams cancelled after 1-3 blocks and 10 non-streamed requests given up on: 0 leaked slots
    (/health and /metrics show every slot free), and later requests answer as before."""
    t0 = time.monotonic()
    seen, gave_up = asyncio.run(_disconnects(server, 100, 10))
    assert all(n >= 1 for n in seen) and all(gave_up)  # each hung up mid-stream / mid-request
    assert_unaffected(server, before)
    metrics = httpx.get(f"http://127.0.0.1:{server}/{APP}/metrics", timeout=30).text
    assert f'dllm_free_slots{{model="{MODEL}"}} {float(NUM_SLOTS)}' in metrics
    print(f"\n{len(seen)} streams cancelled mid-stream ({sum(seen)} blocks read) and {len(gave_up)} non-streamed "
          f"requests abandoned in {time.monotonic() - t0:.1f} s: 0 slots leaked")
