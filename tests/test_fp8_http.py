"""An FP8 checkpoint served end to end: the tiny FP8-dynamic DiffusionGemma (the format users serve,
RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic) through the real app over HTTP, as `make serve
MODEL=<tiny fp8>` serves it, with no argument saying it is quantized: its config.json does."""
import httpx
import pytest
import torch

from deployments.app import build_app
from model.sampling.params import DecodeParams
from tests import served
from tests.serve_harness import serving
from workers.engine import Engine

pytestmark = pytest.mark.shared_serve

PROMPT = [2, 17, 230, 41, 989, 512, 77]


@pytest.fixture(scope="module")
def server(tiny_fp8_gemma):
    with serving({"fp8": build_app({"model": str(tiny_fp8_gemma), "served_model_name": "gemma-fp8",
                                    "max_model_len": 256})}) as port:
        yield port


def test_the_fp8_checkpoint_serves_what_the_engine_computes(server, tiny_fp8_gemma):
    base = f"http://127.0.0.1:{server}/fp8/v1"
    models = httpx.get(f"{base}/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["gemma-fp8"]
    body = {"model": "gemma-fp8", "prompt": PROMPT, "max_tokens": 32, "seed": 7, "logprobs": 1, "ignore_eos": True}
    r = httpx.post(f"{base}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 32 and choice["finish_reason"] == "length"
    # the in-process engine on one thread, as the served shard runs (serve_harness: DLLM_SHARD_THREADS=1):
    # another thread count sums the fp32 matmuls in another order, and a rounding-sized difference that
    # moves an activation across an FP8 rounding boundary is a whole FP8 step, which the tiny model's
    # self-conditioning loop then amplifies (the second canvas differs by 0.17 in logprob on 2 threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(str(tiny_fp8_gemma), num_slots=2, max_model_len=256) as engine:
            (expected,) = served.generate(engine, [PROMPT], [DecodeParams(seed=7, max_tokens=32, ignore_eos=True,
                                                                           logprobs=1)])
    finally:
        torch.set_num_threads(threads)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected.logprobs, abs=1e-6)
    chat = httpx.post(f"{base}/chat/completions", timeout=120, json={
        "model": "gemma-fp8", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 16,
        "seed": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
