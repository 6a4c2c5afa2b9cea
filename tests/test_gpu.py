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


def _stats_case(R, P, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, P, V, generator=gen) * 3).to(dtype).cuda()
    temp = torch.tensor([0.8, 0.0, 1.2][:R], device="cuda")
    return x, temp, torch.tensor([7, 2**40 + 1, 3][:R], device="cuda"), torch.tensor([2, 0, 5][:R], device="cuda")


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_sampler_statistics_equal_torch(family, dtype):
    """Full-size vocabularies: the same tokens (greedy and Gumbel samples), and scores within 1e-3 (bf16
    logits) / 1e-5 (fp32) of the torch pass."""
    from model.kernels.vocab_stats import TRITON_PASSES
    from model.parallel.group import TPGroup
    from model.sampling import stats as S

    if family == "nemotron":
        x, temp, seed, counter = _stats_case(3, 32, 131072, dtype)
        x[..., 100] = -torch.inf  # the mask token
        kw = {}
    else:
        x, temp, seed, counter = _stats_case(2, 256, 262144, dtype)
        kw = dict(softcap=30.0, soft_dtype=torch.bfloat16)
    a = S.vocab_stats(x, temp, seed, counter, 0, TPGroup(), **kw)
    b = S.vocab_stats(x, temp, seed, counter, 0, TPGroup(), passes=TRITON_PASSES, **kw)
    for key in ("greedy", "sample"):
        differ = (getattr(a, key) != getattr(b, key)).nonzero().tolist()
        assert not differ, (key, differ[:5])
    tol = 1e-3 if dtype == torch.bfloat16 else 1e-5
    for key in ("lse_u", "lse_s", "entropy_u", "entropy_s", "lse_soft", "x_sample"):
        diff = (getattr(a, key) - getattr(b, key)).abs().max().item()
        assert diff < tol, (key, diff)
    cap = kw.get("softcap")
    assert (a.logprob_s(a.u_of(a.x_sample, cap)) - b.logprob_s(b.u_of(b.x_sample, cap))).abs().max() < tol


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_no_host_sync_inside_a_command(family, tiny_nemotron, tiny_gemma):
    """A multi-step command reads nothing on the host until its end (sync-debug mode errors on any
    synchronising call; the command's one wait is an event's), admissions, releases and drafts included."""
    from model.parallel.group import TPGroup
    from model.protocol import Command, NewSlot
    from model.sampling.params import DecodeParams
    from workers.shard_group import build_runner

    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    runner = build_runner(str(model_dir), TPGroup(), 4, 256, "bfloat16", "cuda", "safetensors", 8)
    # p also streams drafts: its snapshots are taken inside the captured steps and copied with the rest
    p = DecodeParams(temperature=0.7, seed=1, max_tokens=96, ignore_eos=True, logprobs=2, stream_drafts=True,
                     draft_every=2)
    q = DecodeParams(temperature=0, max_tokens=64, ignore_eos=True)

    def commands():
        runner.execute(Command(admit=(NewSlot(0, (1, 5, 6, 7), p, 1), NewSlot(1, (1, 9), q, 2)), max_steps=8))
        for _ in range(3):
            runner.execute(Command(max_steps=8))
        runner.execute(Command(release=(1,), admit=(NewSlot(1, (1, 3, 3), q, 3),), max_steps=8))
        runner.execute(Command(max_steps=8))
        runner.execute(Command(release=(0, 1), max_steps=0))

    commands()  # warm-up: first runs of each step's plan are eager, then captured
    commands()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        commands()
    finally:
        torch.cuda.set_sync_debug_mode(0)


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
