"""model/kernels/quantize.py under triton's CPU interpreter: each producer's rows and their FP8
quantization against the unfused function (model.fused as written) followed by model.fp8's reference
quantization. Run under TRITON_INTERPRET=1 only (tests/test_interpreted_kernels.py).

The interpreter rounds fp32 to FP8 wrongly, so the kernel is asked here for its quotients in fp32 and
torch rounds them; the FP8 cast itself is the GPU's, and the exact roundings are checked there
(tests/test_fp8_gpu.py)."""
import pytest
import torch

pytest.importorskip("triton")

from model import fused
from model.fp8 import FP8, quantize_per_token
from model.kernels.quantize import quantize


def check(name, got, y, exact):
    (q32, scale), (q_ref, s_ref) = got, quantize_per_token(y)
    s_ref = s_ref[:, 0]
    q = q32.to(FP8).float()
    if exact:   # the same y: the same scale and quotients to the bit
        assert torch.equal(scale, s_ref), name
        assert torch.equal(q32, (y.float() / s_ref[:, None]).clamp(-448, 448)), name
        assert torch.equal(q, q_ref.float()), name
        return
    # y's elements may land on a neighbouring bf16 value: the kernel's sum, exp and rsqrt are not torch's,
    # and the interpreter truncates fp32 to bf16 where the GPU rounds (up to two bf16 steps after a norm's
    # two roundings). So: the scale within two bf16 steps, and every value within an FP8 step plus those.
    # A wrong norm, weight, eps, gate or residual is off by far more.
    torch.testing.assert_close(scale, s_ref, rtol=2 ** -6, atol=0)
    deq, yf = q * scale[:, None], y.float()
    bound = yf.abs() * (2 ** -3 + 2 ** -6) + scale[:, None] * 2 ** -9
    assert ((deq - yf).abs() <= bound).all(), (name, (deq - yf).abs().max())


def test_producers_quantized_in_the_row_kernel():
    gen = torch.Generator().manual_seed(3)

    def bf16(*shape, scale=3.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    f32 = torch.float32
    for rows, k in ((1, 64), (37, 2816), (5, 3000)):        # one row, the 26B-A4B's hidden size, not a power of 2
        x, r = bf16(rows, k), bf16(rows, k)
        x[0, : k // 2] = 0.0
        w = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
        zero = torch.zeros(2, k, dtype=torch.bfloat16)
        check("rows", quantize(x, q_dtype=f32), x, exact=True)
        z = quantize(zero, q_dtype=f32)
        assert (z[1] == 1 / (448 * 512)).all() and (z[0] == 0).all()   # the floor: zeros stay zeros
        check("rms", quantize(x, weight=w, eps=1e-5, norm="ministral", q_dtype=f32), fused.rms_norm(x, w, 1e-5),
              False)
        h, *got = quantize(x, residual=r, weight=w, eps=1e-5, norm="ministral", q_dtype=f32)
        h_ref, y = fused.add_rms_norm(x, r, w, 1e-5)
        torch.testing.assert_close(h.float(), h_ref.float(), rtol=2 ** -7, atol=0)   # a bf16 step (truncated)
        check("add_rms", got, y, False)
        check("gemma_rms", quantize(x, weight=w, eps=1e-6, norm="gemma", q_dtype=f32),
              fused.gemma_rms_norm(x, w, 1e-6), False)
        gate_up = bf16(rows, 2 * k)
        check("silu", quantize(gate_up, gate="silu", q_dtype=f32), fused.silu_mul(gate_up), False)
        check("gelu", quantize(gate_up, gate="gelu", q_dtype=f32), fused.gelu_mul(gate_up), False)
        # rows of a wider tensor (a strided view, as an attention output's rows can be)
        wide = bf16(rows, k + 64)
        check("strided", quantize(wide[:, :k], q_dtype=f32), wide[:, :k], exact=True)
