"""model/compile_watch.py on the CPU: it counts a torch.compile graph when one compiles and none when the
compiled function runs again, and leaves triton's hooks as it found them (the GPU test that no served
shape compiles after warm-up relies on both: tests/test_gpu.py)."""
import torch
from triton import knobs

from model.compile_watch import CompileWatch


def test_a_compile_is_counted_and_a_cached_run_is_not():
    double = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    with CompileWatch() as first:
        double(torch.ones(3))
    with CompileWatch() as again:
        double(torch.full((3,), 2.0))
    with CompileWatch() as new_shape:
        double(torch.ones(5))
    assert first.compiled and first.graphs == 1 and not first.kernels
    assert not again.compiled and "none" in again.summary()
    assert new_shape.graphs == 1


def test_triton_hooks_are_chained_and_restored():
    seen = []
    knobs.runtime.jit_post_compile_hook = theirs = lambda **kw: seen.append(kw["repr"])  # noqa: E731
    try:
        with CompileWatch() as watch:
            hook = knobs.runtime.jit_post_compile_hook
            hook(repr="kernel_a[num_warps=4](x: *fp32)")
        assert watch.kernels[0][0] == "kernel_a" and seen == ["kernel_a[num_warps=4](x: *fp32)"]
        assert knobs.runtime.jit_post_compile_hook is theirs and knobs.runtime.jit_cache_hook is None
    finally:
        knobs.runtime.jit_post_compile_hook = None
