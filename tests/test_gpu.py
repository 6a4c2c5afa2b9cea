"""GPU tier (run on the GPU host: `pytest -m gpu`): the same model and engine on CUDA in bf16, and the
Serve app on a GPU."""
import random

import pytest
import torch

from tests import served

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_engine(tiny_nemotron):
    from workers.engine import Engine

    with Engine(tiny_nemotron, num_slots=8, max_model_len=512, device="cuda", dtype="bfloat16") as e:
        yield e


def test_cuda_bf16_logits_track_the_fp32_reference(tiny_nemotron):
    from model.attention import PagedKVCache, StepContext, step_context
    from model.loader import load_model
    from tests.reference import hf_ministral3

    model = load_model(tiny_nemotron, dtype="bfloat16", device="cuda", show_progress=False)
    ref = hf_ministral3(tiny_nemotron)
    ids = torch.randint(0, 997, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    layers, hkv, d = model.kv_shape
    kv = PagedKVCache.per_slot([(hkv, d)] * layers, 1, 256, torch.bfloat16, "cuda")
    ctx = StepContext.build(kv, [0], [0], [120], [True], 120, "cuda")
    with step_context(ctx), torch.no_grad():
        got = model.head_logits(model(ids.cuda(), torch.arange(120, device="cuda")[None]))[0].float().cpu()
    assert (got - expected).abs().max() < 0.1 * expected.std()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


def test_cuda_engine_alone_equals_in_batch(cuda_engine):
    from model.sampling.params import DecodeParams

    rng = random.Random(3)
    probe = ([1] + [rng.randrange(101, 997) for _ in range(20)],
             DecodeParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2))
    alone = served.generate(cuda_engine, [probe[0]], [probe[1]])[0]
    others = [([1] + [rng.randrange(101, 997) for _ in range(rng.randint(3, 50))],
               DecodeParams(temperature=0.8, seed=i, max_tokens=rng.randint(5, 90), logprobs=[None, 0, 5][i % 3]))
              for i in range(5)]
    batch = others[:2] + [probe] + others[2:]
    together = served.generate(cuda_engine, [p for p, _ in batch], [q for _, q in batch])[2]
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
    logits) / 1e-5 (fp32) of the torch pass; the scored rows' rank counts and top-k keys exactly."""
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
    # the scored rows' second read: rank counts and the top 20 keys, exactly
    tok = torch.gather(x, 2, a.sample.unsqueeze(-1)).squeeze(-1)
    for k in (0, 20):
        ca, ka = S.torch_rank_top_k(x, tok, k, 0)
        cb, kb = TRITON_PASSES.rank_top_k(x, tok, k, 0)
        assert torch.equal(ca, cb) and (k == 0 or torch.equal(ka, kb)), k


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_no_host_sync_inside_a_command(family, invariant, tiny_nemotron, tiny_gemma):
    """A multi-step command reads nothing on the host until its end (sync-debug mode errors on any
    synchronising call; the command's one wait is an event's), admissions, releases and drafts included."""
    from model.parallel.group import TPGroup
    from model.protocol import Command, NewSlot
    from model.sampling.params import DecodeParams
    from model.checkpoint import RunnerArgs
    from model.runner import Runner

    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    runner = Runner.from_checkpoint(RunnerArgs.read(model_dir, num_slots=4, max_model_len=256, dtype="bfloat16",
                                                    device="cuda", max_steps_per_command=8,
                                                    batch_invariant=invariant), TPGroup())
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


def test_cuda_ar_rows_ride_in_the_canvas_graphs(tiny_nemotron):
    """Warmed up (fp32): AR requests beside canvas requests replay only canvas graphs (model/steps/masked.py's
    AR rows; no AR graph, no eager step, no capture) and get the tokens they get alone in the AR graphs,
    their logprobs within 1e-4."""
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    ar = [DecodeParams(mode="ar", temperature=t, seed=s, max_tokens=24, ignore_eos=True, logprobs=2)
          for t, s in ((0, 1), (0.8, 2))]
    canvas = [DecodeParams(temperature=0.7, seed=3, max_tokens=64, ignore_eos=True, logprobs=1),
              DecodeParams(mode="linear_spec", max_tokens=40, ignore_eos=True)]
    prompts = [[1, 300, 301, 302], [1] + list(range(400, 440)), [1, 7, 8], [1, 9, 9, 9]]
    # no prefix caching: the second run's prompts would then start past position 0, whose prefills run eagerly
    with Engine(tiny_nemotron, num_slots=4, max_model_len=256, device="cuda", dtype="float32",
                enable_prefix_caching=False) as e:
        runner = e.shards.runner
        runner.warm_up()
        captured = runner.graphs.captured
        kinds = []
        run = runner.graphs.run
        runner.graphs.run = lambda key, *a: (kinds.append(key[0]), run(key, *a))[1]
        alone = served.generate(e, prompts[:2], ar)
        assert "ar" in kinds and "canvas" not in kinds
        kinds.clear()
        together = served.generate(e, prompts, ar + canvas)
        assert "canvas" in kinds and "ar" not in kinds   # both canvas requests outlast the AR ones
        assert (runner.graphs.captured, runner.graphs.eager_steps) == (captured, 0)
    for a, t in zip(alone, together[:2]):
        assert t.output == a.output
        assert t.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_serve_app_on_gpu(tiny_nemotron):
    """The app on a GPU: its replica is ready only with its CUDA graphs captured (the set the warm-up
    reports); requests of every option mix then capture nothing and run no step outside a graph."""
    openai = pytest.importorskip("openai")
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from ray import serve

    from deployments.app import build_app
    from tests.serve_harness import ray_log_tails, start_serve, stop_serve, wait_running

    def metrics(port) -> dict:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    port = start_serve(env_vars={})
    try:
        serve._run(build_app({"model": str(tiny_nemotron), "served_model_name": "tiny", "device": "cuda",
                              "dtype": "bfloat16", "max_model_len": 512}), name="gpu", route_prefix="/",
                   _blocking=False)
        try:   # bounded, naming each deployment's state and Serve's message, and what Ray's logs said
            wait_running(["gpu"], 300)
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{ray_log_tails()}") from None
        ready = metrics(port)
        assert ready["dllm_cuda_graphs"] > 100 and ready["dllm_cuda_graph_memory_bytes"] > 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny", prompt="Hello", max_tokens=40, logprobs=2, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 40 and len(r.choices[0].logprobs.token_logprobs) == 40
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=33, stream=True, temperature=0,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        mixes = [(dict(temperature=0.7, logprobs=5), {"top_k": 17}), (dict(top_p=0.5), {"diffusion": {"policy": "leftmost"}}),
                 (dict(temperature=0, logprobs=1), {"diffusion": {"mode": "ar"}}),
                 (dict(temperature=1.0, top_p=0.9), {"top_k": 3, "diffusion": {"policy": "entropy_bound"}})]
        for i, (options, extra) in enumerate(mixes * 2):
            r = c.completions.create(model="tiny", prompt=f"Hello {i}", max_tokens=20 + 7 * i,
                                     extra_body={"ignore_eos": True, **extra}, **options)
            assert r.usage.completion_tokens == 20 + 7 * i
        after = metrics(port)
        assert after["dllm_graph_captures_total"] == 0 and after["dllm_eager_steps_total"] == 0
        assert after["dllm_kernel_compiles_total"] == 0
        assert after["dllm_cuda_graphs"] == ready["dllm_cuda_graphs"]
    finally:
        stop_serve()


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_cuda_graph_set_serves_every_option_mix(family, tiny_nemotron, tiny_gemma):
    """A warmed-up CUDA runner holds exactly the graph set's formula; tests/test_graph_plans.py's mix of
    every option then captures nothing and runs no step eagerly, and gives, in fp32, the tokens of a
    runner without graphs (exact plans, no padding) and its logprobs within 1e-3."""
    from tests.test_graph_plans import GEMMA_MIX, NEMOTRON_MIX, outcome, prompts_of
    from workers.engine import Engine

    model_dir, mix, vocab = (tiny_nemotron, NEMOTRON_MIX, 900) if family == "nemotron" else (tiny_gemma, GEMMA_MIX, 500)
    prompts = prompts_of(len(mix), vocab)
    with Engine(model_dir, num_slots=4, max_model_len=256, device="cuda", dtype="float32") as e:
        e.shards.runner.graphs = None
        expected = outcome(e, prompts, mix)
    with Engine(model_dir, num_slots=4, max_model_len=256, device="cuda", dtype="float32") as e:
        runner = e.shards.runner
        report = runner.warm_up()
        assert runner.graphs.captured == sum(report["graphs"].values()) and report["graph_bytes"] > 0
        got = outcome(e, prompts, mix)
        assert runner.graphs.captured == sum(report["graphs"].values()) and runner.graphs.eager_steps == 0
    for g, x in zip(got, expected):
        assert (g[0], g[2], g[3], g[5:]) == (x[0], x[2], x[3], x[5:])
        if x[1] is not None:
            assert max(abs(a - b) for a, b in zip(g[1], x[1])) < 1e-3


@pytest.mark.parametrize("family,dtype,offset", [("nemotron", "bfloat16", 0.0), ("nemotron", "float32", 0.0),
                                                 ("gemma", "bfloat16", 0.0), ("nemotron", "bfloat16", -8.0),
                                                 ("gemma", "bfloat16", -8.0)])
def test_triton_thresholds_equal_torch(family, dtype, offset):
    """The filters' thresholds on full-size vocabularies in bf16 (16-bit keys) and fp32 (32-bit): triton's
    radix select over the raw logits' keys against torch's over the decided values; with the logits
    shifted below 0 too (negative bf16 keys decode back to their own values)."""
    from model.kernels.filters import triton_threshold
    from model.parallel.group import TPGroup
    from model.sampling.filters import torch_threshold

    R, P, V, kw = (4, 32, 131072, dict(on_scaled=True)) if family == "nemotron" else \
        (4, 256, 262144, dict(softcap=30.0, on_scaled=False))
    scale = 3.0 if offset == 0 else 1.5
    x = (torch.randn(R, P, V, generator=torch.Generator().manual_seed(0)) * scale + offset).to(getattr(torch, dtype))
    x = x.cuda()
    temp = torch.tensor([0.7, 0.0, 1.3, 1.0], device="cuda")
    top_k = torch.tensor([5, 0, 499, 0], device="cuda")
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0], device="cuda")
    a = torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
    b = triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[3]).all() and torch.isfinite(a[:3]).all()
    assert torch.allclose(a, b, rtol=1e-6, atol=0), (a - b).abs().max()


@pytest.mark.parametrize("family,dtype", [("nemotron", torch.bfloat16), ("nemotron", torch.float32),
                                          ("gemma", torch.bfloat16)])
def test_top_k_1_keeps_its_maximum_and_scores_it_log_1(family, dtype):
    """top_k 1 at T = 0.7 on a full-size vocabulary: the filter's threshold is the maximum's own value as
    torch computes it (Nemotron: x / T; DiffusionGemma: the softcap), the statistics pass keeps that
    entry, the sampled token's logprob is log 1 = 0 (fp32: no ties) or log(1 / ties) (bf16), never above
    0 before the sampler's clamp, and the scores list the token among its own alternatives at that
    logprob (not as filtered). With triton's approximate division the threshold sat above its maximum at
    70 of 512 positions and 155 logprobs were positive (H100, Nemotron bf16)."""
    from types import SimpleNamespace

    from model.kernels.vocab_stats import TRITON_PASSES
    from model.parallel.group import TPGroup
    from model.sampling import stats as S
    from model.slots import SlotTable
    from model.steps.sampler import RowSampler

    softcap, (R, P, V) = (None, (16, 32, 131072)) if family == "nemotron" else (30.0, (4, 256, 262144))
    on_scaled = softcap is None
    x = (torch.randn(R, P, V, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).cuda()
    temp = torch.full((R,), 0.7, device="cuda")
    top_k, top_p = torch.ones(R, dtype=torch.int64, device="cuda"), torch.ones(R, device="cuda")
    thr = TRITON_PASSES.threshold(x, temp, top_k, top_p, 0, TPGroup(), softcap=softcap, on_scaled=on_scaled)
    top_u = S.unscaled(x, softcap).amax(-1)
    assert torch.equal(thr, top_u / temp[:, None] if on_scaled else top_u)
    st = S.vocab_stats(x, temp, torch.arange(R, device="cuda"), torch.zeros(R, dtype=torch.int64, device="cuda"), 0,
                       TPGroup(), softcap=softcap, threshold=thr, threshold_on_scaled=on_scaled, passes=TRITON_PASSES)
    ties = (x.float() == x.float().amax(-1, keepdim=True)).sum(-1)
    logprob = S.unscaled(st.x_sample, softcap) / temp[:, None] - st.lse_s
    assert torch.equal(st.x_sample, x.float().amax(-1))
    assert torch.allclose(logprob, -torch.log(ties.float()), rtol=0, atol=4e-6) and (logprob <= 0).all()
    if dtype == torch.float32:
        assert (logprob == 0).all()
    slots = SlotTable(R, P, 0, torch.device("cuda"))
    slots.temperature[:R], slots.logprobs[:R] = temp, 2
    sampler = RowSampler(SimpleNamespace(tp=TPGroup(), vocab_start=0, logit_softcap=softcap), slots, TRITON_PASSES)
    rows = torch.arange(R, device="cuda")
    scores = sampler.scores(x, st, st.x_sample, rows, 2, rows)
    alone = ties == 1
    assert torch.equal(scores.top_ids[..., 0][alone], st.sample[alone])
    assert torch.equal(scores.top_values[..., 0], scores.logprob)


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_cuda_compiled_updates_equal_written(family, tiny_nemotron, tiny_gemma):
    """The canvas steps' state updates as inductor compiles them on CUDA (the runner's default) against
    as written, both in CUDA graphs, in bf16, on tests/test_compiled_update.py's batches: the same
    tokens, scores, steps and finish reasons."""
    from model.steps.compiled import CompiledUpdate
    from tests.test_compiled_update import BATCHES, batch_prompts, engine, run

    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    torch._dynamo.reset()   # a fresh limit of variants, whatever the suite compiled before
    compiled = engine(model_dir, "cuda", "bfloat16")
    written = engine(model_dir, "cuda", "bfloat16")
    step = written.shards.runner.canvas_step
    step.update = CompiledUpdate(step._update, on=False)
    expected = run(written, batch_prompts(family), BATCHES[family])
    got = run(compiled, batch_prompts(family), BATCHES[family])
    assert compiled.shards.runner.canvas_step.update.compiled is not None, "the update fell back to running as written"
    assert got == expected


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_cuda_graphed_prefill_equals_eager(family, tiny_nemotron, tiny_gemma):
    """Prefills captured and replayed as CUDA graphs at padded widths (model/graphs.py) against a runner
    without graphs, prefilling at the prompts' own widths, in fp32: the same tokens and logprobs within
    1e-4; and the graphed runner's three rounds (each prefill eager, captured, replayed) the same bits."""
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    model_dir, bos = (tiny_nemotron, 1) if family == "nemotron" else (tiny_gemma, 2)
    prompts = [[bos] + list(range(100, 120)), [bos] + list(range(200, 237))]   # widths 32 and 64
    params = DecodeParams(seed=3, max_tokens=32, ignore_eos=True, logprobs=2)

    def rounds(graphs: bool, n: int):
        # no prefix caching: a round's prompts would then be cached prefixes, whose prefills run eagerly
        with Engine(model_dir, num_slots=4, max_model_len=256, device="cuda", dtype="float32",
                    enable_prefix_caching=False) as e:
            runner = e.shards.runner
            if not graphs:
                runner.graphs = None
            out = [[served.generate(e, [p], [params])[0] for p in prompts] + served.generate(e, prompts, [params] * 2)
                   for _ in range(n)]
            captured = [k for k, g in runner.graphs.graphs.items() if k[0] == "prefill" and g] if graphs else []
        return out, {(k[1].rows, k[1].kv_len) for k in captured}

    graphed, captured = rounds(True, 3)
    eager, _ = rounds(False, 1)
    assert captured == {(1, 32), (1, 64), (2, 64)}
    fields = lambda r: (r.output, r.logprobs, r.ranks, r.top_ids, r.top_logprobs)  # noqa: E731
    assert [[fields(r) for r in run] for run in graphed[1:]] == [[fields(r) for r in graphed[0]]] * 2
    for g, e in zip(graphed[0], eager[0]):
        assert g.output == e.output
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-4


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_cuda_graphed_prefill_past_a_prefix_equals_eager(family, tiny_nemotron, tiny_gemma):
    """A conversation's next turns, prefilled past their cached prefix by graphs the warm-up captured
    (over the cache's whole length of keys: attention splits each row's own keys), against a runner
    without graphs, in fp32: the same tokens, logprobs within 1e-4, and not one eager step."""
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    model_dir, bos = (tiny_nemotron, 1) if family == "nemotron" else (tiny_gemma, 2)
    base = [bos] + list(range(100, 140))
    turns = [base + list(range(300, 307)), base + list(range(400, 437)), base + list(range(500, 530))]
    params = DecodeParams(seed=3, max_tokens=16, ignore_eos=True, logprobs=2)

    def run(graphs: bool):
        with Engine(model_dir, num_slots=2, max_model_len=256, device="cuda", dtype="float32") as e:
            runner = e.shards.runner
            if graphs:
                runner.warm_up()
            else:
                runner.graphs = None
            served.generate(e, [base], [params])
            out = [served.generate(e, [t], [params])[0] for t in turns[:2]] + served.generate(e, turns[1:], [params] * 2)
            assert e.scheduler.pages.hits >= 4
            return out, (runner.graphs.eager_steps if graphs else None)

    (graphed, eager_steps), (eager, _) = run(True), run(False)
    assert eager_steps == 0
    for g, e in zip(graphed, eager):
        assert g.output == e.output and g.top_ids == e.top_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-4


def _gemma_alone_and_together(model_dir, dtype, batch_invariant=False):
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    with Engine(model_dir, num_slots=4, max_model_len=256, device="cuda", dtype=dtype,
                batch_invariant=batch_invariant) as e:
        probe = ([2, 50, 60, 70, 80], DecodeParams(seed=3, max_tokens=32, ignore_eos=True, logprobs=2))
        alone = served.generate(e, [probe[0]], [probe[1]])[0]
        together = served.generate(e, [[2, 9, 9, 9], probe[0]],
                                   [DecodeParams(seed=1, max_tokens=16, ignore_eos=True), probe[1]])[1]
        fixed = served.generate(e, [[2, 11]], DecodeParams(seed=1, max_tokens=32, ignore_eos=True,
                                                           max_denoising_steps=4, confidence_threshold=0))[0]
    return alone, together, fixed


def test_cuda_diffusion_gemma_engine_fp32(tiny_gemma):
    alone, together, fixed = _gemma_alone_and_together(tiny_gemma, "float32")
    assert len(alone.output) == 32 and alone.ranks == [1] * 32
    assert fixed.denoising_steps == 8 and fixed.canvases == 2
    assert together.output == alone.output
    assert max(abs(a - b) for a, b in zip(together.logprobs, alone.logprobs)) < 1e-3


def test_cuda_diffusion_gemma_bf16_batch_invariant(tiny_gemma):
    """In bf16 the default kernels round a row differently in another batch and the renoise sampler's
    Gumbel draws then pick other tokens (the contrast below); the batch-invariant mode gives the same bits."""
    alone, together, fixed = _gemma_alone_and_together(tiny_gemma, "bfloat16", batch_invariant=True)
    assert len(alone.output) == 32 and fixed.denoising_steps == 8
    assert together.output == alone.output
    assert together.logprobs == alone.logprobs and together.top_logprobs == alone.top_logprobs


def test_cuda_diffusion_gemma_bf16_default_kernels_differ_in_a_batch(tiny_gemma):
    """The contrast that gives the test above its meaning: with the default kernels the same comparison
    shows other bits (on an H200 before the batch-invariant mode, the first token already differed), so
    equal bits there are the mode's doing, not a batch too small to matter."""
    alone, together, _ = _gemma_alone_and_together(tiny_gemma, "bfloat16", batch_invariant=False)
    assert len(together.logprobs) == len(alone.logprobs) == 32
    assert together.logprobs != alone.logprobs


def _nemotron_alone_and_together(model_dir, batch_invariant: bool):
    """A sampled probe with logprobs, alone and as the third of eight requests of other lengths (prompts of
    60-300 tokens against its 21), temperatures and logprob options: its prefill and steps run at other
    shapes than alone, which the default kernels' tiling and reduction order follow."""
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    rng = random.Random(5)
    probe = ([1] + [rng.randrange(101, 997) for _ in range(20)],
             DecodeParams(temperature=0.7, seed=9, max_tokens=64, ignore_eos=True, logprobs=3))
    others = [([1] + [rng.randrange(101, 997) for _ in range(rng.randint(60, 300))],
               DecodeParams(temperature=[0, 0.8][i % 2], seed=i, max_tokens=rng.randint(5, 90),
                            logprobs=[None, 0, 5][i % 3])) for i in range(7)]
    with Engine(model_dir, num_slots=8, max_model_len=512, device="cuda", dtype="bfloat16",
                batch_invariant=batch_invariant) as e:
        alone = served.generate(e, [probe[0]], [probe[1]])[0]
        batch = others[:2] + [probe] + others[2:]
        together = served.generate(e, [p for p, _ in batch], [q for _, q in batch])[2]
    return alone, together


def test_cuda_nemotron_bf16_batch_invariant(tiny_nemotron):
    """The probe alone and among seven neighbours: the same tokens and the same logprobs, bit for bit."""
    alone, together = _nemotron_alone_and_together(tiny_nemotron, batch_invariant=True)
    assert together.output == alone.output
    assert together.logprobs == alone.logprobs and together.top_logprobs == alone.top_logprobs


def test_cuda_nemotron_bf16_default_kernels_differ_in_a_batch(tiny_nemotron):
    """The contrast that gives the test above its meaning: the same comparison with the default kernels
    shows other bits in the probe's logprobs, so equal bits there are the mode's doing."""
    alone, together = _nemotron_alone_and_together(tiny_nemotron, batch_invariant=False)
    assert len(together.logprobs) == len(alone.logprobs) == 64
    assert together.logprobs != alone.logprobs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_kernels_on_cuda(dtype):
    """Full-size shapes: the fixed-order matmul, grouped matmul and row sums agree with torch's, and a
    row's result is the same bits at 1, 32 and 512 rows (wherever it sits)."""
    from model.kernels import invariant as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for n, k in ((6144, 4096), (4096, 14336), (262144, 2816)):
        w = torch.randn(n, k, device="cuda", generator=gen).to(dtype) / k ** 0.5
        x = torch.randn(512, k, device="cuda", generator=gen).to(dtype)
        y = K.matmul(x, w)
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert (y.float() - ref).abs().max() < tol * ref.abs().max(), (n, k)
        assert torch.equal(K.matmul(x[40:41], w), y[40:41]) and torch.equal(K.matmul(x[17:49], w)[23:24], y[40:41])
    e, n, k = 128, 1408, 2816
    w = torch.randn(e, n, k, device="cuda", generator=gen).to(dtype) / k ** 0.5
    counts = torch.randint(0, 40, (e,), device="cuda", generator=gen)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(ends[-1]), k, device="cuda", generator=gen).to(dtype)
    y = K.grouped_matmul(x, w, ends)
    group = torch.repeat_interleave(torch.arange(e, device="cuda"), counts)
    ref = torch.einsum("ni,noi->no", x.float(), w.float()[group])
    assert (y.float() - ref).abs().max() < tol * ref.abs().max()
    g = int(group[100])
    one = torch.zeros(e, dtype=torch.int32, device="cuda")
    one[g:] = 1
    assert torch.equal(K.grouped_matmul(x[100:101], w, one), y[100:101])
    h = torch.randn(300, 2816, device="cuda", generator=gen).to(dtype)
    s = K.row_sum(h, square=True)
    assert torch.allclose(s, h.float().pow(2).sum(-1), rtol=1e-5) and torch.equal(K.row_sum(h[7:8], square=True), s[7:8])


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_kv_pool_is_sized_from_gpu_memory(family, tiny_nemotron, tiny_gemma):
    """gpu_memory_utilization: the pool takes what the share leaves after everything in use and twice
    the steps' measured peak; a sliding group stops at what its slots can hold at once; the pool serves
    what a pool of kv_cache_tokens serves; a share too small for one request is a clear error."""
    import gc

    from model.kv_budget import ahead_positions, sliding_pages
    from model.protocol import PREFILL_CHUNK
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    probe = ([1] + list(range(101, 141)), DecodeParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
    with Engine(model_dir, num_slots=4, max_model_len=512, device="cuda", dtype="bfloat16") as e:
        expected = served.generate(e, [probe[0]], [probe[1]])[0]
    gc.collect()
    torch.cuda.empty_cache()   # what that engine's allocator cached is free for the next, as size_pool frees it
    free, total = torch.cuda.mem_get_info()
    with Engine(model_dir, num_slots=4, max_model_len=512, device="cuda", dtype="bfloat16",
                gpu_memory_utilization=0.25) as e:
        runner = e.shards.runner
        sizing, kv = runner.pool_report["kv_sizing"], runner.kv
        assert sizing["total_bytes"] == total and sizing["steps_peak_bytes"] > 0
        assert sizing["pool_bytes"] <= 0.25 * total - (total - free) - 2 * sizing["steps_peak_bytes"] + 2**20
        assert sizing["pool_bytes"] > 0.9 * (0.25 * total - (total - free) - 2 * sizing["steps_peak_bytes"]) - 2**30
        full = [n for n, w in zip(kv.num_pages, kv.windows) if w is None]
        assert full[0] * kv.page_size > 100 * 4 * (512 + runner.C)
        for n, w in zip(kv.num_pages, kv.windows):
            if w is not None:
                cap = 4 * sliding_pages(w, ahead_positions(512, PREFILL_CHUNK, runner.outputs.max_steps, runner.C),
                                        kv.page_size)
                assert n == min(full[0], cap)
        assert e.scheduler.pages.capacity_tokens == full[0] * kv.page_size
        got = served.generate(e, [probe[0]], [probe[1]])[0]
        assert got.output == expected.output
        del runner, kv
    gc.collect()
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.001"):
        Engine(model_dir, num_slots=4, max_model_len=512, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.001)


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_cuda_cached_and_chunked_prefills_equal_cold_bit_for_bit(family, tiny_nemotron, tiny_gemma):
    """batch_invariant=true in bf16: a request served past a cached prefix, and one whose prompt is
    prefilled in chunks beside a decoding neighbour, give the tokens and logprobs of the request served
    cold and whole, to the bit (every prefill reads its keys through the cache with one kernel)."""
    from model.sampling.params import DecodeParams
    from workers.engine import Engine

    model_dir = tiny_nemotron if family == "nemotron" else tiny_gemma
    rng = random.Random(11)
    prompts = [[2] + [rng.randrange(10, 900) for _ in range(n)] for n in (150, 97, 40)]
    params = [DecodeParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              DecodeParams(seed=3, max_tokens=33, ignore_eos=True, logprobs=1),
              DecodeParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0)]
    kw = dict(num_slots=4, max_model_len=512, device="cuda", dtype="bfloat16", batch_invariant=True)

    def same(got, ref):
        assert got.output == ref.output and got.logprobs == ref.logprobs and got.top_ids == ref.top_ids

    with Engine(model_dir, enable_prefix_caching=False, **kw) as never:
        cold = [served.generate(never, [p], [q])[0] for p, q in zip(prompts, params)]
    with Engine(model_dir, **kw) as e:
        served.generate(e, prompts, params)
        again = served.generate(e, prompts, params)
        assert e.scheduler.pages.hits > 0
    with Engine(model_dir, enable_prefix_caching=False, prefill_chunk=32, **kw) as e:
        chunked = served.generate(e, prompts, params)
    for a, c, ref in zip(again, chunked, cold):
        same(a, ref)
        same(c, ref)


def _forget_compiled_kernels() -> None:
    """This process's compiled variants of every triton kernel of model/kernels, and torch.compile's code: a
    later call compiles (or loads from disk) again, and a CompileWatch hears it."""
    import importlib
    import pkgutil

    import triton

    import model.kernels

    for info in pkgutil.iter_modules(model.kernels.__path__):
        for value in vars(importlib.import_module(f"model.kernels.{info.name}")).values():
            jit = triton.runtime.jit.JITFunction
            fn = value if isinstance(value, jit) else getattr(value, "fn", None)   # or an autotuner's
            if isinstance(fn, jit):
                fn.device_caches.clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_served_shapes_compile_nothing_after_warm_up(family, tiny_nemotron, tiny_gemma):
    """After warm-up, what users send compiles no kernel: fresh prompts, prompts past a cached prefix at
    widths that are and are not multiples of 16, a long prompt prefilled in chunks, in every mode, and
    constrained requests (a verify limited at every draft position runs eagerly). A
    compile inside a served step stalls the whole replica for about a second (the first time a shape
    comes), so the warm-up must have compiled every variant the served shapes reach."""
    from model.compile_watch import CompileWatch
    from model.sampling.params import DecodeParams
    from tests.test_structured import SCHEMA, grammar, tokenizers_of
    from workers.engine import Engine

    model_dir, vocab = (tiny_nemotron, 900) if family == "nemotron" else (tiny_gemma, 500)
    rng = random.Random(5)
    words = lambda n: [rng.randrange(10, vocab) for _ in range(n)]   # noqa: E731
    modes = [DecodeParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
    if family == "nemotron":
        modes += [DecodeParams(temperature=0, max_tokens=20, ignore_eos=True, mode="ar"),
                  DecodeParams(temperature=0, max_tokens=24, ignore_eos=True, mode="linear_spec", logprobs=1)]
    _forget_compiled_kernels()   # what earlier tests of this process compiled must not hide what warm-up misses
    with Engine(model_dir, num_slots=4, max_model_len=512, device="cuda", dtype="bfloat16", prefill_chunk=96) as e:
        e.shards.runner.warm_up()
        base = [2] + words(70)
        with CompileWatch() as watch:
            served.generate(e, [base], modes[0])                    # fresh, graphed
            for extra in (1, 7, 16, 23, 40, 77):                    # past the cached prefix, one at a time
                for params in modes:
                    served.generate(e, [base + words(extra)], params)
            served.generate(e, [base + words(230)], modes[0])       # chunks of 96 past a cached prefix
            served.generate(e, [[2] + words(300)] * 2, modes[-1])   # two long prompts, fresh then continued
            g = grammar(tokenizers_of(model_dir), "json_schema", SCHEMA)   # constrained: host checks, and
            bound = [DecodeParams(temperature=0, max_tokens=32, grammar=g)]   # eager verifies (linear_spec)
            if family == "nemotron":
                bound.append(DecodeParams(mode="linear_spec", max_tokens=32, grammar=g))
            served.generate(e, [base + words(5)] * len(bound), bound)
        runner = e.shards.runner
        assert runner.compiles is not None   # the serving watch, from the warm-up's end
        print(f"{family}: eager steps after warm-up {runner.graphs.eager_steps if runner.graphs else None}; {watch.summary()}")
    assert not watch.compiled, watch.summary()
