"""GPU tier, FP8 (`pytest -m gpu`, an FP8-capable GPU): model/kernels/fp8.py against model/fp8.py's
reference, kernel by kernel and through whole models, in CUDA graphs."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu


def _quantized(rows: int, k: int, seed: int):
    from model.fused import quantize_rows

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(torch.bfloat16)
    x[0] = 0   # a row of zeros: the scale's floor
    return x, quantize_rows(x.cuda())


def _weights(*shape: int, seed: int):
    from model.fp8 import quantize_per_channel

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    q, s = quantize_per_channel(w)
    return q.cuda(), s.float().cuda()


@pytest.mark.parametrize("k", [2816, 4096, 14336])
def test_quantize_rows_is_the_reference_rounding(k):
    """The per-row quantization (model/kernels/quantize.py: IEEE divisions, the GPU's round-to-nearest FP8
    cast) gives the reference's scales and FP8 values bit for bit, and the floor for a row of zeros."""
    from model.fp8 import quantize_per_token

    x, a = _quantized(300, k, 0)
    q, s = quantize_per_token(x)
    assert torch.equal(a.scale.cpu(), s[:, 0])
    assert a.scale[0].item() == pytest.approx(1 / (448 * 512)) and (a.q[0].float() == 0).all()
    assert torch.equal(a.q.cpu().float(), q.float())


def _close_to(a, y: torch.Tensor) -> None:
    """Quantized rows `a` dequantize to y [rows, K] (the unfused function's bf16 output) within one FP8
    step (e4m3: 3 mantissa bits, so 2^-3 relative; 2^-9 of the scale below the normals) plus y's own bf16
    rounding, which the fused kernel may skip (inductor keeps its intermediates in fp32). A wrong norm,
    weight or scale is off by far more."""
    from model.fp8 import dequantize

    assert a.q.shape == y.shape and a.scale.shape == y.shape[:1] and a.dtype == y.dtype
    got, y = dequantize(a.q, a.scale[:, None], torch.float32).cpu(), y.float().cpu()
    bound = y.abs() * (2 ** -3 + 2 ** -8) + a.scale.cpu()[:, None] * 2 ** -9
    assert ((got - y).abs() <= bound).all(), (got - y).abs().max()


def test_norms_and_activations_quantize_their_outputs_in_their_kernels():
    """model.fused's producer-fused quantizations (model/kernels/quantize.py's row kernel; inductor's for
    DiffusionGemma's feed-forward inputs) against the unfused function followed by the reference
    quantization."""
    from model import fused

    gen = torch.Generator().manual_seed(5)
    x, r = ((torch.randn(2, 37, 2816, generator=gen) * 3).to(torch.bfloat16).cuda() for _ in "xr")
    w1, w2 = ((torch.rand(2816, generator=gen) + 0.5).to(torch.bfloat16).cuda() for _ in "12")
    scale = torch.rand(2816, generator=gen).to(torch.bfloat16).cuda()
    rows = lambda t: t.reshape(-1, t.shape[-1])   # noqa: E731
    _close_to(fused.rms_norm_quantized(x, w1, 1e-5), rows(fused.rms_norm(x, w1, 1e-5)))
    h, a = fused.add_rms_norm_quantized(x, r, w1, 1e-5)
    h_ref, y = fused.add_rms_norm(x, r, w1, 1e-5)
    assert torch.equal(h, h_ref) and a.shape == x.shape
    _close_to(a, rows(y))
    _close_to(fused.gemma_rms_norm_quantized(x, w1, 1e-6), rows(fused.gemma_rms_norm(x, w1, 1e-6)))
    dense, moe, router = fused.gemma_feedforward_inputs_quantized(rows(x), w1, w2, scale, 2816 ** -0.5, 1e-6)
    dense_ref, moe_ref, router_ref = fused.gemma_feedforward_inputs(rows(x), w1, w2, scale, 2816 ** -0.5, 1e-6)
    _close_to(dense, dense_ref)
    _close_to(moe, moe_ref)
    torch.testing.assert_close(router, router_ref)
    gate_up = torch.cat([x, r], -1)
    _close_to(fused.silu_mul_quantized(gate_up), rows(fused.silu_mul(gate_up)))
    _close_to(fused.gelu_mul_quantized(gate_up), rows(fused.gelu_mul(gate_up)))


@pytest.mark.parametrize("k", [2816, 14336])
@pytest.mark.parametrize("m", [1, 32, 37, 256])
@pytest.mark.parametrize("invariant", [False, True], ids=["served", "invariant"])
def test_scaled_linear_equals_the_reference(invariant, m, k):
    """torch._scaled_mm with row and channel scales (or our fixed-order split-K kernel, 4 and 8 splits
    here: for the batch-invariant mode, and served for few rows through a deep weight, here 1 and 32 rows
    through 2112 x 14336) = the reference's fp32 product of the same FP8 values, rounded once to bf16 (up
    to fp32 summation order)."""
    from model.fp8 import dequantize
    from model.kernels.fp8 import scaled_linear, split_k_wins

    x, a = _quantized(m, k, m)
    w, sw = _weights(2112, k, seed=1)
    assert split_k_wins(m, *w.shape) == (m <= 32 and k == 14336)
    got = scaled_linear(a.q, a.scale, w, sw, torch.bfloat16, invariant).float()
    ref = dequantize(a.q, a.scale[:, None], torch.float32) @ dequantize(w, sw, torch.float32).t()
    torch.testing.assert_close(got, ref.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("variant", ["triton", "triton-swapped", "triton-chunked", "cutlass"])
@pytest.mark.parametrize("tokens", [3, 40, 300])
def test_scaled_grouped_equals_the_reference(variant, tokens):
    """Both grouped FP8 kernels (the triton one also with swapped 16-row tiles, y^T = W x^T, and reading the
    weight chunked for its tiles, as the served experts do: then the same bits as the dense weight's),
    gathering token rows (gate/up) and reading pair rows (down), against the reference per expert; experts
    with no rows included."""
    from functools import partial

    from model.fp8 import dequantize
    from model.kernels import fp8 as K
    from model.kernels.invariant import Tiles, chunk_weight
    from model.moe import sort_pairs

    E, k, H, N = 16, 4, 512, 384
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(E - 3, generator=gen)[:k] for _ in range(tokens)]).cuda()   # 3 idle experts
    pairs = sort_pairs(ids, E)
    x, a = _quantized(tokens, H, 2)
    w, sw = _weights(E, N, H, seed=3)
    run = {"triton": K.grouped_in_triton, "triton-chunked": K.grouped_in_triton, "cutlass": K.grouped_in_cutlass,
           "triton-swapped": partial(K.grouped_in_triton, tiles=Tiles(16, 128, 128, 4, 4, True))}[variant]
    got = run(a.q, a.scale, w, sw[..., 0].contiguous(), pairs.ends, pairs.token, torch.bfloat16).float()
    if variant == "triton-chunked":
        chunked = chunk_weight(w, K.EXPERT_TILES.gate_up.n, K.EXPERT_TILES.gate_up.k)
        chunked_got = K.grouped_in_triton(a.q, a.scale, chunked, sw[..., 0].contiguous(), pairs.ends, pairs.token,
                                          torch.bfloat16, tiles=K.EXPERT_TILES.gate_up)
        assert torch.equal(chunked_got.float(), got)
        assert torch.equal(K.scaled_grouped(a.q, a.scale, chunked, sw[..., 0].contiguous(), pairs.ends, pairs.token,
                                            torch.bfloat16, tiles=K.EXPERT_TILES.gate_up).float(), got)
    expert = ids.flatten()[torch.argsort(ids.flatten(), stable=True)]
    xr = dequantize(a.q, a.scale[:, None], torch.float32)[pairs.token]
    ref = torch.einsum("pk,pnk->pn", xr, dequantize(w, sw, torch.float32)[expert])
    torch.testing.assert_close(got, ref.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


@contextlib.contextmanager
def reference_only():
    """Every FP8 layer through model/fp8.py's reference, as on a GPU without FP8 kernels."""
    import model.moe
    import model.parallel.linear

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.parallel.linear, "kernels_take", lambda x: False)
        mp.setattr(model.moe, "kernels_take", lambda x: False)
        yield


def test_fp8_nemotron_logits_with_kernels_track_the_reference(tiny_fp8_nemotron):
    """A whole FP8 model's logits through the kernels against the same model through the reference (bf16
    on CUDA both). They differ by summation order and bf16 roundings, which FP8 amplifies: where the two
    paths' inputs to a quantization differ by an ulp, a value may round to its neighbour, 1/16 apart. A
    wrong scale or layout would be off by the logits' own size."""
    from model.attention import PagedKVCache, StepContext, step_context
    from model.loader import load_model

    model = load_model(tiny_fp8_nemotron, dtype="bfloat16", device="cuda", show_progress=False)
    ids = torch.randint(0, 997, (1, 120), generator=torch.Generator().manual_seed(0)).cuda()
    layers, hkv, d = model.kv_shape

    def logits():
        kv = PagedKVCache.per_slot([(hkv, d)] * layers, 1, 256, torch.bfloat16, "cuda")
        ctx = StepContext.build(kv, [0], [0], [120], [True], 120, "cuda")
        with step_context(ctx), torch.no_grad():
            return model.head_logits(model(ids, torch.arange(120, device="cuda")[None]))[0].float().cpu()

    got = logits()
    with reference_only():
        expected = logits()
    err, agree = (got - expected).abs().max() / expected.std(), (got.argmax(-1) == expected.argmax(-1)).float().mean()
    assert err < 0.5 and agree > 0.9, (err, agree)


def test_fp8_forward_in_a_cuda_graph_replays_to_the_eager_forward(tiny_fp8_nemotron):
    """The 8B-shaped FP8 forward (cuBLAS's FP8 GEMMs, the norms' and activations' quantizations, the
    attention output's row pass) captured in a CUDA graph: its replay gives the eager forward's logits bit
    for bit (the same shapes run the same kernels), so nothing in the FP8 path is baked in at capture."""
    from model.attention import PagedKVCache, StepContext, step_context
    from model.loader import load_model

    model = load_model(tiny_fp8_nemotron, dtype="bfloat16", device="cuda", show_progress=False)
    ids = torch.randint(0, 997, (1, 120), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(120, device="cuda")[None]
    layers, hkv, d = model.kv_shape
    ctx = StepContext.build(PagedKVCache.per_slot([(hkv, d)] * layers, 1, 256, torch.bfloat16, "cuda"), [0], [0], [120], [True], 120,
                            "cuda")

    def forward():
        with step_context(ctx), torch.no_grad():
            return model.head_logits(model(ids, positions))

    eager = forward().clone()
    forward()   # compiles done before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_fp8_engine_in_cuda_graphs(family, tiny_fp8_nemotron, tiny_fp8_gemma):
    """A warmed-up FP8 runner (the kernels inside its CUDA graphs) serves requests with no eager step and no
    capture; and in the batch-invariant mode, whose kernels' results do not depend on the padded rows and
    key buckets a graph runs at, the graphed runner's tokens and logprobs equal those of the same runner
    without graphs, bit for bit. Tokens are not compared with the reference path: a random tiny model's
    greedy picks are near-ties that FP8's roundings flip, and one flip changes every later canvas
    (test_fp8_nemotron_logits_with_kernels_track_the_reference compares one forward's logits instead)."""
    from model.sampling.params import DecodeParams
    from tests import served
    from workers.engine import Engine

    model_dir, vocab = (tiny_fp8_nemotron, 900) if family == "nemotron" else (tiny_fp8_gemma, 500)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    params = DecodeParams(max_tokens=32, temperature=0, ignore_eos=True, seed=1, logprobs=1)

    def run(graphs: bool, invariant: bool) -> list[tuple]:
        with Engine(model_dir, num_slots=2, max_model_len=128, device="cuda", dtype="bfloat16",
                    batch_invariant=invariant) as e:
            runner = e.shards.runner
            if graphs:
                report = runner.warm_up()
                captured = runner.graphs.captured
                assert captured == sum(report["graphs"].values()), report["graphs"]
            else:
                runner.graphs = None
            outs = served.generate(e, prompts, params)   # the scores as the outputs carry them
            if graphs:
                assert (runner.graphs.captured, runner.graphs.eager_steps) == (captured, 0)
            return [(o.output, o.logprobs) for o in outs]

    default = run(graphs=True, invariant=False)
    assert [len(tokens) for tokens, _ in default] == [32] * 3
    assert all(all(lp <= 0 for lp in logprobs) for _, logprobs in default)
    assert run(graphs=True, invariant=True) == run(graphs=False, invariant=True)


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_fp8_models_keep_a_requests_bits_among_neighbours_in_the_batch_invariant_mode(family, tiny_fp8_nemotron,
                                                                                      tiny_fp8_gemma):
    """The batch-invariant mode with FP8 weights (model.kernels.invariant's kernels with FP8 operands, the
    norms' and activations' quantizations row by row): a probe alone and among neighbours, the same tokens
    and logprobs bit for bit (tests/test_gpu.py's comparisons, whose contrasts show the default kernels
    differ)."""
    from tests.test_gpu import _gemma_alone_and_together, _nemotron_alone_and_together

    if family == "nemotron":
        alone, together = _nemotron_alone_and_together(tiny_fp8_nemotron, batch_invariant=True)
    else:
        alone, together, _ = _gemma_alone_and_together(tiny_fp8_gemma, "bfloat16", batch_invariant=True)
    assert together.output == alone.output
    assert together.logprobs == alone.logprobs and together.top_logprobs == alone.top_logprobs
