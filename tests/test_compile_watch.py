"""model/compile_watch.py on the CPU: it counts a torch.compile graph when one compiles and none when the
compiled function runs again, hears triton's compiles through hooks that chain whatever was installed,
and serves watches opened and closed in any order (the GPU test that no served shape compiles after
warm-up relies on it beside the runner's own watch: tests/test_gpu.py)."""
import pytest
import torch
from triton import knobs

from model.compile_watch import CompileWatch


@pytest.fixture
def hooks():
    """triton's hooks as found, put back after the test."""
    found = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = found


def compiled(name: str) -> None:
    """What triton does around a compile: its cache hook, then its post-compile hook."""
    knobs.runtime.jit_cache_hook(key=None, repr=f"{name}[num_warps=4](x: *fp32)")
    knobs.runtime.jit_post_compile_hook(key=None, repr=f"{name}[num_warps=4](x: *fp32)")


def test_a_compile_is_counted_and_a_cached_run_is_not(hooks):
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


def test_triton_hooks_chain_what_was_installed(hooks):
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"].split("[")[0])
    with CompileWatch() as watch:
        compiled("kernel_a")
    compiled("kernel_b")   # after the watch closed: theirs still hears it, the watch does not
    assert [name for name, _ in watch.kernels] == ["kernel_a"] and seen == ["kernel_a", "kernel_b"]


def test_watches_open_and_close_in_any_order(hooks):
    """A runner's watch, open for the process's life, beside a test's, opened before it and closed while
    it stays open: each hears the compiles of its own time, `on_compile` and `count` as they come."""
    told = []
    outer = CompileWatch().start()
    runner = CompileWatch(on_compile=lambda name, took: told.append(name)).start()
    compiled("kernel_c")
    outer.stop()
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))
    compiled("kernel_d")
    assert runner.count == 3 and told == ["kernel_c", "kernel_d"]
    assert [name for name, _ in outer.kernels] == ["kernel_c"] and outer.count == 1
    assert runner.start() is runner and runner.count == 3   # starting an open watch again changes nothing
    runner.stop()
    compiled("kernel_e")
    assert runner.count == 3


def test_a_closed_engines_runner_stops_its_watch(tiny_nemotron, hooks):
    """A runner's watch ends with its engine: a later engine's warm-up in the same process is not logged
    as compiled while serving by an earlier runner's watch (on CUDA warm_up starts it; here, by hand)."""
    from model.compile_watch import _active
    from workers.engine import Engine

    with Engine(tiny_nemotron, num_slots=1, max_model_len=64) as e:
        runner = e.shards.runner
        runner.compiles = CompileWatch().start()
        assert runner.compiles in _active
    assert runner.compiles not in _active
