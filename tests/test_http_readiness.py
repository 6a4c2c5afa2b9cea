"""`GET /health` tells the truth while a model replica warms up (DESIGN: 503 with a reason while warming
up; 200 only when a request would be served now), and generation requests are refused with a 503 at
once instead of held until the replica runs.

The ingress is the real one, over Serve, HTTP and the tiny checkpoint; its coordinator here is a stand-in
deployment whose constructor returns only once the test releases it (it has seen the ingress answer while
the replica warms up), as a real one's returns only once its shards have loaded their weights and captured
their CUDA graphs (workers/serve_coordinator.py; on the CPU that takes well under a second, too short a
window to watch). What the stand-in answers once running is the real coordinator's stats shape for the
fields the ingress reads."""
import asyncio
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from deployments.ingress import OpenAIIngress
from deployments.args import AppArgs
from model.checkpoint import Checkpoint
from tests.serve_harness import assert_openai_error, delete_apps, shared_serve

pytestmark = pytest.mark.shared_serve

MAX_WARM_UP_S = 60.0   # the stand-in's warm-up ends by itself after this (the test has failed by then)


@serve.deployment(name="Coordinator")
class WarmingCoordinator:
    async def __init__(self, release: str, max_s: float):
        """Warms up until the file `release` exists (the test creates it), max_s at most. A fixed delay
        had to outlast the ingress's own start on a slow machine (12 s, where the ingress takes ~6)."""
        deadline = time.monotonic() + max_s
        while not Path(release).exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def stats(self) -> dict:
        return {"state": "ready", "num_slots": 2, "free_slots": 2, "running": 0, "waiting": 0, "shard_failures": 0,
                "kv_cache_tokens": 128, "kv_cache_usage": 0.0}

    async def check_health(self) -> None:
        pass


@pytest.fixture(scope="module")
def warming(tiny_nemotron, tmp_path_factory):
    port = shared_serve()
    release = tmp_path_factory.mktemp("warming") / "release"
    try:
        args = AppArgs(model=str(tiny_nemotron)).model_dump()
        app = OpenAIIngress.bind(WarmingCoordinator.bind(str(release), MAX_WARM_UP_S), args,
                                 Checkpoint.read(tiny_nemotron))
        serve._run(app, name="warming", route_prefix="/warming", _blocking=False)   # not waiting for it to run
        yield f"http://127.0.0.1:{port}/warming", release
    finally:
        release.touch()   # a failed test's replica stops warming up, so that it can be deleted
        delete_apps()


def test_health_is_503_while_warming_up_then_200(warming, tiny_nemotron):
    base, release = warming
    body = {"model": tiny_nemotron.name, "prompt": [1, 2, 3], "max_tokens": 4}
    seen_503 = False
    answered_in = []   # seconds each 503 of /health took
    released = False   # the replica may finish its warm-up (before that, it certainly warms up)
    deadline = time.monotonic() + MAX_WARM_UP_S + 30
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
            assert released, "/health answered 200 while the replica was still warming up"
            break
        assert r.status_code == 503, r.text
        error = assert_openai_error(r.json(), 503)
        assert error["type"] == "service_unavailable" and "warming up" in error["message"] and r.headers["retry-after"]
        answered_in.append(time.monotonic() - asked)
        seen_503 = True
        start = time.monotonic()
        g = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        if not released:   # certainly still warming: refused at once
            assert g.status_code == 503 and "warming up" in g.json()["error"]["message"], g.text
            assert time.monotonic() - start < 5
            if len(answered_in) >= 3:   # enough seen of the warm-up: let it end
                release.touch()
                released = True
        time.sleep(0.2)
    else:
        pytest.fail("/health never answered 200")
    assert seen_503, "the ingress came up only after the replica was ready: nothing was checked"
    # the first caller waits STATS_S for the held stats call; while it stays held, HELD_PROBE_S at most
    assert len(answered_in) >= 3 and max(answered_in[1:]) < 1.0, answered_in
    assert r.json()["status"] == "ok" and r.json()["free_slots"] == 2
