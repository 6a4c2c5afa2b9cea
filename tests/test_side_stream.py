"""model.side_stream: a layer's independent branch on a second CUDA stream. On the GPU (`pytest -m gpu`):
the fork and the join order the branch's work, eagerly and in a CUDA graph, and DiffusionGemma serves the
same bits with its dense MLP beside the experts as without. On the CPU the branch runs inline."""
from __future__ import annotations

import pytest
import torch

from model.side_stream import SideBranch, side_branch

gpu = pytest.mark.gpu


def test_off_cuda_the_branch_runs_inline():
    branch = side_branch(torch.ones(2))
    with branch:
        y = torch.ones(2) * 3
    branch.join()
    assert branch.stream is None and torch.equal(y, torch.full((2,), 3.0))


def _branch_work(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x doubled on the current stream, then on the branch a chain of matmuls long enough (milliseconds)
    that reading its result before the join, or starting it before the doubling, gives other values."""
    x.mul_(2)
    branch = side_branch(x)
    assert branch.stream is not None and branch.stream != torch.cuda.current_stream()
    with branch:
        y = x
        for _ in range(40):
            y = (y @ x) / x.shape[0]
    branch.join()
    return y, y.sum()


@gpu
def test_the_fork_and_the_join_order_the_branch_eagerly_and_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.rand(2048, 2048, device="cuda", generator=gen)
    expected = x0 * 2
    y = expected
    for _ in range(40):
        y = (y @ expected) / 2048
    x = x0.clone()
    got, total = _branch_work(x)
    assert torch.equal(got, y) and torch.equal(total, y.sum())

    x.copy_(x0)
    _branch_work(x)          # warm: cuBLAS's workspace for the side stream
    x.copy_(x0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, total = _branch_work(x)
    for _ in range(3):
        x.copy_(x0)
        total.zero_()
        graph.replay()
        assert torch.equal(got, y) and torch.equal(total, y.sum())


@gpu
@pytest.mark.parametrize("checkpoint", ["bf16", "fp8"])
def test_gemma_serves_the_same_bits_with_its_dense_mlp_on_the_side_stream(checkpoint, tiny_gemma, tiny_fp8_gemma,
                                                                          monkeypatch):
    """A warmed-up runner (every step in a CUDA graph) serves the same tokens and logprobs with the dense
    MLP beside the experts as one after the other: the same kernels on the same inputs."""
    from model import diffusion_gemma
    from model.sampling.params import DecodeParams
    from tests import served
    from workers.engine import Engine

    model_dir = tiny_gemma if checkpoint == "bf16" else tiny_fp8_gemma
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in (5, 40)]
    params = DecodeParams(max_tokens=48, seed=1, ignore_eos=True, logprobs=2)

    def run(beside: bool) -> list[tuple]:
        if not beside:   # the branch inline, as off CUDA: the dense MLP, then the routing, on one stream
            monkeypatch.setattr(diffusion_gemma, "side_branch", lambda x: SideBranch(None))
        with Engine(model_dir, num_slots=2, max_model_len=128, device="cuda", dtype="bfloat16") as e:
            e.shards.runner.warm_up()
            outs = served.generate(e, prompts, params)
            assert e.shards.runner.graphs.eager_steps == 0
        return [(o.output, o.logprobs, o.top_logprobs) for o in outs]

    beside = run(True)
    assert [len(tokens) for tokens, *_ in beside] == [48, 48]
    assert beside == run(False)
