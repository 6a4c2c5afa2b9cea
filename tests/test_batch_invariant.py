"""Batch-invariant mode (model/batch_invariant.py) on the CPU: its tensor-parallel sum adds the ranks'
parts in rank order (gloo); it is refused where its kernels cannot run. Its triton kernels, under
triton's interpreter, are tests/interpreted/test_interpreted_batch_invariant.py's (run by
tests/test_interpreted_kernels.py); the end-to-end check (a request alone and in a batch, bf16, both
families) is tests/test_gpu.py's."""
from pathlib import Path

import pytest
import torch

from tests.tp_harness import spawn_tp


def ordered_sum_worker(rank: int, world_size: int, out_dir: str) -> None:
    from model.batch_invariant import batch_invariant
    from model.parallel.group import TPGroup

    tp = TPGroup.from_default_group()
    parts = torch.randn(world_size, 4096, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e4, 1.0, -1e4])[:, None]
    with batch_invariant():
        total = tp.all_reduce(parts[rank].clone())
    torch.save(total, Path(out_dir) / f"rank{rank}.pt")


def test_tensor_parallel_sum_adds_ranks_in_order(tmp_path):
    """Three gloo ranks whose parts cancel: every rank gets ((p0 + p1) + p2), bit for bit."""
    spawn_tp(ordered_sum_worker, 3, tmp_path, str(tmp_path))
    parts = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e4, 1.0, -1e4])[:, None]
    expected = (parts[0] + parts[1]) + parts[2]
    for r in range(3):
        assert torch.equal(torch.load(tmp_path / f"rank{r}.pt"), expected)


def test_refused_without_cuda(tiny_nemotron):
    from pydantic import ValidationError

    from deployments.args import AppArgs
    from model.checkpoint import RunnerArgs
    from model.runner import Runner

    with pytest.raises(ValidationError, match="batch_invariant=true needs device=cuda"):
        AppArgs(device="cpu", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant needs device cuda"):
        Runner.from_checkpoint(RunnerArgs.read(tiny_nemotron, num_slots=2, max_model_len=128, batch_invariant=True))
