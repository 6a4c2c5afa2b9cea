"""Times of the fused elementwise chains (model/fused.py) at the benchmark shapes, compiled against
eager, on one GPU: a check that each compiles to the one kernel it should be (microseconds). Then the
FP8 activations' producers: model/kernels/quantize.py's row kernel against inductor's compiled chain
(what model.fused ran before it) and eager, each replayed in a CUDA graph (the served path's launch).

    python3 -m benchmarks.fused_kernels
"""
from __future__ import annotations

import torch
from triton.testing import do_bench, do_bench_cudagraph

from model import fused


def cases():
    bf = dict(dtype=torch.bfloat16, device="cuda")
    t, h = 32, 4096
    qkv = torch.randn(1, t, 6144, **bf)
    q, k = qkv[..., :4096].view(1, t, 32, 128), qkv[..., 4096:5120].view(1, t, 8, 128)
    cos, sin, scale = torch.randn(1, t, 1, 128, **bf), torch.randn(1, t, 1, 128, **bf), torch.randn(1, t, 1, 1, **bf)
    x, r, w = torch.randn(1, t, h, **bf), torch.randn(1, t, h, **bf), torch.randn(h, **bf)
    yield "rotary 8B", fused.rotary, (q, k, cos, sin, scale)
    yield "add_rms_norm 8B", fused.add_rms_norm, (x, r, w, 1e-5)
    yield "silu_mul 8B", fused.silu_mul, (torch.randn(1, t, 28672, **bf),)
    t, h = 256, 2816
    g = torch.randn(t, h, **bf)
    yield "gemma_feedforward_inputs 26B", fused.gemma_feedforward_inputs, (g, torch.randn(h, **bf), torch.randn(h, **bf),
                                                                           torch.randn(h, **bf), h ** -0.5, 1e-6)
    gq = torch.randn(1, t, 16 * 256 + 2 * 8 * 256, **bf)
    yield "gemma_qkv 26B", fused.gemma_qkv, (gq[..., :4096].view(1, t, 16, 256), gq[..., 4096:6144].view(1, t, 8, 256),
                                             gq[..., 6144:].view(1, t, 8, 256), torch.randn(256, **bf),
                                             torch.randn(256, **bf), 1e-6, torch.randn(1, t, 1, 256, **bf),
                                             torch.randn(1, t, 1, 256, **bf))
    yield "gelu_mul experts 26B", fused.gelu_mul, (torch.randn(t * 8, 2 * 704, **bf),)


def quantize_cases():
    """(name, row kernel call, inductor's chain, its args) at the served shapes: the 8B at 32 and 512 rows,
    the 26B-A4B's one canvas (256 rows; its experts' 2048 pairs)."""
    from model.kernels.quantize import quantize

    bf = dict(dtype=torch.bfloat16, device="cuda")
    for t in (32, 512):
        x, r, w = torch.randn(t, 4096, **bf), torch.randn(t, 4096, **bf), torch.randn(4096, **bf)
        yield f"rms_norm 8B x{t}", lambda x=x, w=w: quantize(x, weight=w, eps=1e-5, norm="ministral"), \
            fused._rms_norm_quantized, (x, w, 1e-5)
        yield f"add_rms_norm 8B x{t}", lambda x=x, r=r, w=w: quantize(x, residual=r, weight=w, eps=1e-5,
                                                                      norm="ministral"), \
            fused._add_rms_norm_quantized, (x, r, w, 1e-5)
        yield f"rows 8B attn out x{t}", lambda x=x: quantize(x), fused._quantized_rows, (x,)
        g = torch.randn(t, 28672, **bf)
        yield f"silu_mul 8B x{t}", lambda g=g: quantize(g, gate="silu"), fused._silu_mul_quantized, (g,)
    h, w = torch.randn(256, 2816, **bf), torch.randn(2816, **bf)
    yield "gemma_rms_norm 26B x256", lambda: quantize(h, weight=w, eps=1e-6, norm="gemma"), \
        fused._gemma_rms_norm_quantized, (h, w, 1e-6)
    for k in (4096, 8192):
        a = torch.randn(256, k, **bf)
        yield f"rows 26B attn out {k} x256", lambda a=a: quantize(a), fused._quantized_rows, (a,)
    for t, k in ((256, 4224), (2048, 1408)):
        g = torch.randn(t, k, **bf)
        yield f"gelu_mul 26B [{t}, {k}]", lambda g=g: quantize(g, gate="gelu"), fused._gelu_mul_quantized, (g,)


def main() -> None:
    print(f"{'function':32} {'compiled us':>12} {'eager us':>10}")
    with torch.inference_mode():
        for name, fn, args in cases():
            fn(*args)
            compiled = do_bench(lambda: fn(*args), return_mode="median") * 1e3
            # rotary and gemma_qkv are triton kernels on CUDA, not compiled chains: no eager twin to time
            unfused = getattr(fn, "__wrapped__", None)
            eager = f"{do_bench(lambda: unfused(*args), return_mode='median') * 1e3:10.1f}" if unfused else f"{'-':>10}"
            print(f"{name:32} {compiled:12.1f} {eager}")
        print(f"\n{'FP8 producer':32} {'row kernel us':>14} {'inductor us':>12} {'eager us':>10}  (CUDA graphs)")
        for name, kernel, chain, args in quantize_cases():
            kernel(), chain(*args)   # compiled before the graphs capture them
            times = [do_bench_cudagraph(f, return_mode="median") * 1e3
                     for f in (kernel, lambda: chain(*args), lambda: chain.__wrapped__(*args))]
            print(f"{name:32} {times[0]:14.1f} {times[1]:12.1f} {times[2]:10.1f}")


if __name__ == "__main__":
    main()
