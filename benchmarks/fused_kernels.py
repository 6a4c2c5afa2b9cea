"""Times of the fused elementwise chains (model/fused.py) at the benchmark shapes, compiled against
eager, on one GPU: a check that each compiles to the one kernel it should be (microseconds).

    python3 -m benchmarks.fused_kernels
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

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


def main() -> None:
    print(f"{'function':32} {'compiled us':>12} {'eager us':>10}")
    with torch.inference_mode():
        for name, fn, args in cases():
            fn(*args)
            compiled = do_bench(lambda: fn(*args), return_mode="median") * 1e3
            eager = do_bench(lambda: fn.__wrapped__(*args), return_mode="median") * 1e3
            print(f"{name:32} {compiled:12.1f} {eager:10.1f}")


if __name__ == "__main__":
    main()
