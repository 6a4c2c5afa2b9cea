"""GPU tier (run on the GPU host: `pytest -m gpu`): the same model and engine on CUDA in bf16, and the
Serve app on a GPU."""
import random

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_engine(tiny_nemotron):
    from workers.engine import Engine

    with Engine(tiny_nemotron, num_slots=8, max_model_len=512, device="cuda", dtype="bfloat16") as e:
        yield e


def test_cuda_bf16_logits_track_the_fp32_reference(tiny_nemotron):
    from model.attention import KVCache, StepContext, step_context
    from model.loader import load_model
    from tests.reference import hf_ministral3

    model = load_model(tiny_nemotron, dtype="bfloat16", device="cuda", show_progress=False)
    ref = hf_ministral3(tiny_nemotron)
    ids = torch.randint(0, 997, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    layers, hkv, d = model.kv_shape
    kv = KVCache(layers, 1, 256, hkv, d, torch.bfloat16, "cuda")
    ctx = StepContext.build(kv, [0], [0], [120], [True], 120, "cuda")
    with step_context(ctx), torch.no_grad():
        got = model.compute_logits(model(ids.cuda(), torch.arange(120, device="cuda")[None]))[0].float().cpu()
    assert (got - expected).abs().max() < 0.1 * expected.std()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


def test_cuda_engine_alone_equals_in_batch(cuda_engine):
    from model.sampling.params import DecodeParams

    rng = random.Random(3)
    probe = ([1] + [rng.randrange(101, 997) for _ in range(20)],
             DecodeParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2))
    alone = cuda_engine.generate([probe[0]], [probe[1]])[0]
    others = [([1] + [rng.randrange(101, 997) for _ in range(rng.randint(3, 50))],
               DecodeParams(temperature=0.8, seed=i, max_tokens=rng.randint(5, 90), logprobs=[None, 0, 5][i % 3]))
              for i in range(5)]
    batch = others[:2] + [probe] + others[2:]
    together = cuda_engine.generate([p for p, _ in batch], [q for _, q in batch])[2]
    assert together.output == alone.output
    assert max(abs(a - b) for a, b in zip(together.logprobs, alone.logprobs)) < 0.02


def test_cuda_ar_and_linear_speculation_agree(cuda_engine):
    from model.sampling.params import DecodeParams

    prompts = [[1, 300, 301, 302], [1] + list(range(400, 440))]
    ar = cuda_engine.generate(prompts, DecodeParams(mode="ar", temperature=0, max_tokens=48, ignore_eos=True))
    spec = cuda_engine.generate(prompts, DecodeParams(mode="linear_spec", max_tokens=48, ignore_eos=True))
    assert [r.output for r in ar] == [r.output for r in spec]


def test_serve_app_on_gpu(tiny_nemotron):
    openai = pytest.importorskip("openai")
    from ray import serve

    from deployments.app import build_app
    from tests.serve_harness import start_serve, stop_serve

    port = start_serve()
    try:
        serve.run(build_app({"model": str(tiny_nemotron), "served_model_name": "tiny", "device": "cuda",
                             "dtype": "bfloat16", "max_model_len": 512}), name="gpu", route_prefix="/")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny", prompt="Hello", max_tokens=40, logprobs=2, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 40 and len(r.choices[0].logprobs.token_logprobs) == 40
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=33, stream=True, temperature=0,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        stop_serve()


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from model.tiny import write_diffusion_gemma

    return write_diffusion_gemma(tmp_path_factory.mktemp("gemma-gpu"), seed=0)


def _gemma_alone_and_together(model_dir, dtype):
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    with Engine(model_dir, num_slots=4, max_model_len=256, device="cuda", dtype=dtype) as e:
        probe = ([2, 50, 60, 70, 80], DecodeParams(seed=3, max_tokens=32, ignore_eos=True, logprobs=2))
        alone = e.generate([probe[0]], [probe[1]])[0]
        together = e.generate([[2, 9, 9, 9], probe[0]],
                              [DecodeParams(seed=1, max_tokens=16, ignore_eos=True), probe[1]])[1]
        fixed = e.generate([[2, 11]], DecodeParams(seed=1, max_tokens=32, ignore_eos=True, max_denoising_steps=4,
                                                   confidence_threshold=0))[0]
    return alone, together, fixed


def test_cuda_diffusion_gemma_engine_fp32(tiny_gemma):
    alone, together, fixed = _gemma_alone_and_together(tiny_gemma, "float32")
    assert len(alone.output) == 32 and alone.ranks == [1] * 32
    assert fixed.denoising_steps == 8 and fixed.canvases == 2
    assert together.output == alone.output
    assert max(abs(a - b) for a, b in zip(together.logprobs, alone.logprobs)) < 1e-3


@pytest.mark.xfail(strict=True, reason="bf16 forwards round differently for different batch shapes, and the "
                   "renoise sampler's Gumbel draws at T 0.4-0.8 then pick other tokens: batch-invariant "
                   "kernels are not done yet (seen on an H200: the first token already differs)")
def test_cuda_diffusion_gemma_engine_bf16_isolation(tiny_gemma):
    alone, together, _ = _gemma_alone_and_together(tiny_gemma, "bfloat16")
    assert together.output == alone.output
