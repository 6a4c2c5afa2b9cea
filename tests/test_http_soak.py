"""A soak over real HTTP, one family per run: CLIENTS clients send mixed requests (every mode the family
has, logprobs on and off, streamed or not, completions and chat) for DLLM_SOAK_S seconds (default 600)
against more slots than they fill. 0 errors, no shard failure; the slot counts stay consistent while
it runs and return to all-free after; the resident memory of every process of the app (ingress,
coordinator, shards) stays flat. Marked `reliability` (make test-reliability)."""
import os
import random
import statistics
import threading
import time

import httpx
import pytest

from benchmarks.http_checks import check_answer
from deployments.app import build_app
from model.tiny import write_diffusion_gemma
from tests.serve_harness import app_processes, idle_and_healthy, rss_mib, serving, stats, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.shared_serve]

SOAK_S = float(os.environ.get("DLLM_SOAK_S", "600"))
CLIENTS, NUM_SLOTS, MAX_QUEUE = 6, 4, 16   # never a 429: every error counts
WARMUP_S = min(30.0, SOAK_S / 5)           # before the memory baseline: allocators and caches settle
SAMPLE_EVERY_S = 5.0
# resident memory may wobble (allocator pools, one large batch) but not climb: the median of the last
# third of the samples within 10% + 32 MiB of the first third's (after warm-up)
RSS_GROWTH, RSS_SLACK_MIB = 1.10, 32.0

C, CHAT = "/v1/completions", "/v1/chat/completions"
TALLY_LOCK = threading.Lock()
MSG = [{"role": "user", "content": "Tell me a story"}]
MIXES = {
    "nemotron": [
        (C, {"prompt": "The sea", "max_tokens": 48, "temperature": 0}),
        (C, {"prompt": "A long road", "max_tokens": 40, "logprobs": 3, "stream": True,
             "diffusion": {"policy": "low_confidence", "max_denoising_steps": 8}}),
        (C, {"prompt": "Once", "max_tokens": 24, "temperature": 0.8, "logprobs": 1, "diffusion": {"mode": "ar"}}),
        (C, {"prompt": [1, 300, 301], "max_tokens": 64, "logprobs": 2, "stream": True,
             "diffusion": {"mode": "linear_spec"}}),
        (CHAT, {"messages": MSG, "max_completion_tokens": 32, "logprobs": True, "top_logprobs": 2,
                "diffusion": {"policy": "entropy_bound", "entropy_bound": 0.3}}),
        (CHAT, {"messages": MSG, "max_tokens": 20, "stream": True, "diffusion": {"mode": "ar"}}),
        (C, {"prompt": "Stop here", "max_tokens": 40, "stop": ["e", "a"], "top_k": 20, "top_p": 0.9,
             "diffusion": {"policy": "leftmost"}}),
    ],
    "gemma": [
        (C, {"prompt": "The sea", "max_tokens": 32, "logprobs": 2}),
        (C, {"prompt": "A long road", "max_tokens": 48, "stream": True,
             "diffusion": {"max_denoising_steps": 4, "confidence_threshold": 0}}),
        (CHAT, {"messages": MSG, "max_completion_tokens": 16, "logprobs": True, "top_logprobs": 1,
                "diffusion": {"t_min": 0.2, "t_max": 0.6}}),
        (C, {"prompt": [2, 300, 301], "max_tokens": 32, "top_k": 50, "top_p": 0.9, "stream": True}),
        (CHAT, {"messages": MSG, "max_tokens": 24, "stop": ["a"], "diffusion": {"entropy_bound": 0.5}}),
    ],
}


@pytest.fixture(scope="module")
def server(tiny_nemotron, tmp_path_factory):
    common = dict(served_model_name="tiny", max_num_seqs=NUM_SLOTS, max_queue=MAX_QUEUE, max_model_len=512)
    gemma = write_diffusion_gemma(tmp_path_factory.mktemp("tiny-gemma-soak"), seed=0)
    with serving({"nemotron": build_app(dict(common, model=str(tiny_nemotron))),
                  "gemma": build_app(dict(common, model=str(gemma)))}) as port:
        yield port


def client(port: int, app: str, index: int, deadline: float, tally: dict, errors: list) -> None:
    rng = random.Random(index)
    mixes = MIXES[app]
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < deadline and not errors:
            path, body = mixes[rng.randrange(len(mixes))]
            body = {"model": "tiny", "ignore_eos": True, "seed": rng.randrange(2**31), **body}
            if body.get("stream"):  # the usage chunk counts a stream's tokens
                body["stream_options"] = {"include_usage": True}
            try:
                r = http.post(f"http://127.0.0.1:{port}/{app}{path}", json=body)
                tokens = check_answer(path, body, r.status_code, r.text)
            except Exception as err:  # reported by the test, with the request that failed
                errors.append(f"{path} {body}: {type(err).__name__}: {err}")
                return
            with TALLY_LOCK:
                tally["requests"] += 1
                tally["tokens"] += tokens


@pytest.mark.timeout(SOAK_S + 900)
@pytest.mark.parametrize("app", ["nemotron", "gemma"])
def test_soak_mixed_requests(server, app):
    t0 = time.monotonic()
    deadline = t0 + SOAK_S
    tally, errors = {"requests": 0, "tokens": 0}, []
    threads = [threading.Thread(target=client, args=(server, app, i, deadline, tally, errors), daemon=True)
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    rss: dict[str, list[tuple[float, float]]] = {}
    slots = []
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        s = stats(app)
        assert s["running"] + s["free_slots"] == NUM_SLOTS and s["running"] <= NUM_SLOTS
        assert s["waiting"] <= MAX_QUEUE and s["shard_failures"] == 0
        slots.append((s["running"], s["waiting"]))
        if now - t0 >= WARMUP_S:
            for name, pid in app_processes(app).items():
                rss.setdefault(name, []).append((now - t0, rss_mib(pid)))
        time.sleep(SAMPLE_EVERY_S)
    for t in threads:
        t.join(150)
    assert not errors, errors[:3]
    wait_until(lambda: idle_and_healthy(server, app), 60, "every slot to be free after the soak")
    assert stats(app)["shard_failures"] == 0

    report = []
    for name, samples in sorted(rss.items()):
        third = max(1, len(samples) // 3)
        first = statistics.median(m for _, m in samples[:third])
        last = statistics.median(m for _, m in samples[-third:])
        report.append(f"{name} {first:.0f}->{last:.0f} MiB")
        assert last <= RSS_GROWTH * first + RSS_SLACK_MIB, f"{name}: RSS {first:.0f} MiB -> {last:.0f} MiB"
    assert {"OpenAIIngress", "Coordinator", "shard0"} <= set(rss), rss.keys()
    elapsed = time.monotonic() - t0
    print(f"\nsoak {app}: {elapsed:.0f} s, {CLIENTS} clients, {tally['requests']} requests, {tally['tokens']} "
          f"completion tokens, 0 errors, 0 shard failures; busiest sample: {max(r for r, _ in slots)} running, "
          f"{max(w for _, w in slots)} waiting; slots all free after; RSS {', '.join(report)}")
