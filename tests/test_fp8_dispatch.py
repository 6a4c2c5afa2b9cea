"""The FP8 kernels' path through the models, on the CPU: where model.fp8.kernels_take says yes, a layer
quantizes its input once (model.fused.quantize_rows, or the gated activation's own kernel) and hands the
Quantized rows to model.kernels.fp8 (tests/test_fp8_gpu.py tests those kernels on a GPU). Here torch's
CPU `_scaled_mm` stands in for cuBLAS's and a dequantized einsum for the grouped kernels, so every CI run
checks the plumbing (which activations are quantized where, the rows gathered for the experts, shapes
back to the caller's) against model/fp8.py's reference path, in fp32 (under tensor parallelism: in
tests/test_fp8_tp.py's ranks, with kernels_on_cpu from here)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import model.fused
import model.kernels.fp8
import model.moe
import model.parallel.linear
from model.batch_invariant import batch_invariant
from model.fp8 import dequantize
from model.loader import load_model
from model.parallel.group import TPGroup
from tests.fp8_reference import schedule


def grouped_on_cpu(xq, sx, w, w_scale, ends, rows, out_dtype, tile_map=None, invariant=False, tiles=None):
    """model.kernels.fp8.scaled_grouped's contract, dequantized: each sorted row times its expert."""
    x = dequantize(xq, sx[:, None], torch.float32)
    if rows is not None:
        x = x[rows]
    expert = torch.searchsorted(ends, torch.arange(x.shape[0], dtype=ends.dtype), right=True)
    return torch.einsum("pk,pnk->pn", x, dequantize(w, w_scale[..., None], torch.float32)[expert]).to(out_dtype)


@contextlib.contextmanager
def kernels_on_cpu(calls: list):
    """kernels_take says yes on the CPU; the grouped kernel is grouped_on_cpu; calls records which ran
    ("/invariant": asked for the fixed-order kernels, which run as the others do here), and every
    activation quantized by a pass of its own ("rows", not in the kernel that produced it)."""
    scaled_linear, quantize_rows = model.kernels.fp8.scaled_linear, model.fused.quantize_rows

    def linear(xq, sx, w, w_scale, out_dtype, invariant=False):
        calls.append("linear/invariant" if invariant else "linear")
        return scaled_linear(xq, sx, w, w_scale, out_dtype)

    def grouped(*args):
        calls.append("grouped/invariant" if args[8:] and args[8] else "grouped")
        return grouped_on_cpu(*args)

    def rows(x):
        calls.append("rows")
        return quantize_rows(x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.parallel.linear, "kernels_take", lambda x: True)
        mp.setattr(model.moe, "kernels_take", lambda x: True)
        mp.setattr(model.kernels.fp8, "scaled_linear", linear)
        mp.setattr(model.kernels.fp8, "scaled_grouped", grouped)
        mp.setattr(model.fused, "quantize_rows", rows)
        yield


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_kernels_path_is_the_reference_path(family, tiny_fp8_nemotron, tiny_fp8_gemma):
    """Both paths quantize the same activations the same way and differ only in where the scales are
    applied (after the FP8 products' sum, or to each factor before it): logits equal to fp32 rounding."""
    net = load_model(tiny_fp8_nemotron if family == "nemotron" else tiny_fp8_gemma, show_progress=False)
    expected = schedule(net, TPGroup())
    calls = []
    with kernels_on_cpu(calls):
        got = schedule(net, TPGroup())
    layers = net.config.num_hidden_layers
    # every FP8 layer of every forward took the kernels: q/k/v, o, gate/up, down; DiffusionGemma's
    # two expert projections, its dense MLP and attention (its routers and self-conditioning stay BF16).
    # Only the attention's output is quantized by a pass of its own: the norms and the gated activations
    # quantize theirs in their own kernels.
    per_forward = {"linear": 4 * layers, "grouped": 2 * layers if family == "gemma" else 0, "rows": layers}
    for kind, n in per_forward.items():
        assert calls.count(kind) == n * len(got), kind
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), f"forward {i}: {(a - b).abs().max():.3g}"


def test_the_batch_invariant_mode_asks_for_the_fixed_order_kernels(tiny_fp8_gemma):
    """In the batch-invariant mode every FP8 layer asks model.kernels.fp8 for its fixed-order kernels
    (tests/interpreted/test_interpreted_batch_invariant.py runs those in the interpreter), none for cuBLAS's or CUTLASS's."""
    net = load_model(tiny_fp8_gemma, show_progress=False)
    calls = []
    with kernels_on_cpu(calls), batch_invariant():
        got = schedule(net, TPGroup())
    layers = net.config.num_hidden_layers
    assert calls.count("linear/invariant") == 4 * layers * len(got) and "linear" not in calls
    assert calls.count("grouped/invariant") == 2 * layers * len(got) and "grouped" not in calls


def test_experts_are_chunked_at_load_where_the_kernels_run(tiny_fp8_gemma):
    """Where the FP8 kernels will run the experts, load_model rewrites each layer's weights chunked for the
    grouped kernel's tiles (model.kernels.invariant.ChunkedWeight): the same values, in the parameter's own
    storage (no second copy). The reference path, which reads the dense layout, then refuses them with an
    error saying why instead of multiplying bytes it does not know the layout of."""
    from model.moe import GemmaExperts

    dense = load_model(tiny_fp8_gemma, show_progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.moe, "kernels_take", lambda x: True)
        chunked = load_model(tiny_fp8_gemma, show_progress=False)
    pairs = [(a, b) for a, b in zip(dense.modules(), chunked.modules(), strict=True) if isinstance(a, GemmaExperts)]
    assert pairs and not any(a.chunked for a, _ in pairs) and all(b.chunked for _, b in pairs)
    for a, b in pairs:
        for chunks, param, dense_param in zip(b.kernel_weights(), (b.gate_up_proj, b.down_proj),
                                              (a.gate_up_proj, a.down_proj), strict=True):
            assert chunks.data.data_ptr() == param.data_ptr()
            assert torch.equal(chunks.dense().view(torch.uint8), dense_param.view(torch.uint8))
    b = pairs[0][1]
    shape = b.gate_up_proj.shape
    with pytest.MonkeyPatch.context() as mp:   # a second call, where the kernels run, leaves them as they are
        mp.setattr(model.moe, "kernels_take", lambda x: True)
        b.chunk_for_kernels(torch.bfloat16)
    assert b.gate_up_proj.shape == shape and b.kernel_weights()[0].data.data_ptr() == b.gate_up_proj.data_ptr()
    with pytest.raises(RuntimeError, match="chunked for the FP8 kernels at load"):
        schedule(chunked, TPGroup())
