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


def test_an_open_watch_counts_as_it_goes_and_reports_each_variant():
    """A served runner's watch (from warm-up on): `count` while open, `on_compile` per triton variant."""
    told = []
    watch = CompileWatch(on_compile=lambda name, took: told.append(name)).start()
    try:
        torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))
        knobs.runtime.jit_post_compile_hook(repr="kernel_b[num_warps=8](y: i32)")
        assert watch.count == 2 and told == ["kernel_b"]
    finally:
        watch.stop()
    assert knobs.runtime.jit_post_compile_hook is None and watch.count == 2
