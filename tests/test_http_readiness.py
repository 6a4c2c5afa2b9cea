"""`GET /health` tells the truth while a model replica warms up (DESIGN: 503 with a reason while warming
up; 200 only when a request would be served now), and generation requests are refused with a 503 at
once instead of held until the replica runs.

The ingress is the real one, over Serve, HTTP and the tiny checkpoint; its coordinator here is a stand-in
deployment whose constructor takes `delay_s` to return, as a real one's does while its shards load their
weights and capture their CUDA graphs (workers/serve_coordinator.py; on the CPU that takes well under a
second, too short a window to watch). What the stand-in answers once running is the real coordinator's
stats shape for the fields the ingress reads."""
import asyncio
import time

import httpx
import pytest
from ray import serve

from deployments.ingress import OpenAIIngress
from deployments.args import AppArgs
from model.checkpoint import Checkpoint
from tests.serve_harness import assert_openai_error, delete_apps, shared_serve

pytestmark = pytest.mark.shared_serve

DELAY_S = 12.0


@serve.deployment(name="Coordinator")
class WarmingCoordinator:
    async def __init__(self, delay_s: float):
        await asyncio.sleep(delay_s)

    def stats(self) -> dict:
        return {"state": "ready", "num_slots": 2, "free_slots": 2, "running": 0, "waiting": 0, "shard_failures": 0,
                "kv_cache_tokens": 128, "kv_cache_usage": 0.0}

    async def check_health(self) -> None:
        pass


@pytest.fixture(scope="module")
def warming(tiny_nemotron):
    port = shared_serve()
    try:
        args = AppArgs(model=str(tiny_nemotron)).model_dump()
        app = OpenAIIngress.bind(WarmingCoordinator.bind(DELAY_S), args, Checkpoint.read(tiny_nemotron))
        serve._run(app, name="warming", route_prefix="/warming", _blocking=False)   # not waiting for it to run
        yield f"http://127.0.0.1:{port}/warming", time.monotonic()
    finally:
        delete_apps()


def test_health_is_503_while_warming_up_then_200(warming, tiny_nemotron):
    base, deployed = warming
    body = {"model": tiny_nemotron.name, "prompt": [1, 2, 3], "max_tokens": 4}
    seen_503 = False
    answered_in = []   # seconds each 503 of /health took
    deadline = deployed + DELAY_S + 60
    while time.monotonic() < deadline:
        try:
            asked = time.monotonic()
            r = httpx.get(f"{base}/health", timeout=10)
        except httpx.HTTPError:   # the ingress itself not up yet
            time.sleep(0.2)
            continue
        if r.status_code == 404:   # the route not registered yet
            time.sleep(0.2)
            continue
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        error = assert_openai_error(r.json(), 503)
        assert error["type"] == "service_unavailable" and "warming up" in error["message"] and r.headers["retry-after"]
        answered_in.append(time.monotonic() - asked)
        seen_503 = True
        start = time.monotonic()
        g = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        if time.monotonic() - deployed < DELAY_S - 4:   # certainly still warming: refused at once
            assert g.status_code == 503 and "warming up" in g.json()["error"]["message"], g.text
            assert time.monotonic() - start < 5
        time.sleep(0.5)
    else:
        pytest.fail("/health never answered 200")
    assert seen_503, "the ingress came up only after the replica was ready: nothing was checked"
    # the first caller waits STATS_S for the held stats call; while it stays held, HELD_PROBE_S at most
    assert len(answered_in) >= 3 and max(answered_in[1:]) < 1.0, answered_in
    assert time.monotonic() - deployed >= DELAY_S - 1   # 200 only once the replica ran
    assert r.json()["status"] == "ok" and r.json()["free_slots"] == 2
