"""Batch-invariant mode (model/batch_invariant.py) on the CPU: its triton kernels, run by triton's
interpreter, equal a float64 reference and give a row the same bits wherever it sits in a batch; its
tensor-parallel sum adds the ranks' parts in rank order (gloo); it is refused where its kernels cannot
run. The end-to-end check (a request alone and in a batch, bf16, both families) is tests/test_gpu.py's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tp_harness import spawn_tp

ROOT = Path(__file__).resolve().parents[1]

KERNEL_CHECK = r"""
import torch
from model.kernels import invariant as K

torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
    for n, k in ((160, 2048), (300, 96)):          # 8 K-splits; one split (K too short to split)
        w = torch.randn(n, k, dtype=dtype)
        x = torch.randn(70, k, dtype=dtype)
        assert K.k_splits(n, k, x.device) == (8 if k == 2048 else 1)
        y = K.matmul(x, w)
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < tol, (dtype, n, k)
        for lo, hi in ((5, 6), (3, 40), (0, 70)):   # row 5 alone, at offset 2 of 37 rows, in all 70
            assert torch.equal(K.matmul(x[lo:hi], w)[5 - lo], y[5]), (dtype, n, k, lo, hi)
        wt = torch.randn(k, n, dtype=dtype)          # a transposed view (the self-conditioning table)
        ref = x.double() @ wt.double()
        assert ((K.matmul(x, wt.t()).double() - ref).abs().max() / ref.abs().max()) < tol
    E, N, D = 6, 40, 96
    w = torch.randn(E, N, D, dtype=dtype)
    counts = torch.tensor([3, 0, 37, 1, 7, 0])       # an empty expert, one spanning three 16-row tiles
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), D, dtype=dtype)
    y = K.grouped_matmul(x, w, ends)
    group = torch.repeat_interleave(torch.arange(E), counts)
    ref = torch.einsum("ni,noi->no", x.double(), w.double()[group])
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < tol
    alone = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32)   # row 20 (expert 2's 18th) alone
    assert torch.equal(K.grouped_matmul(x[20:21], w, alone), y[20:21])
    h = torch.randn(33, 5000, dtype=dtype)
    s = K.row_sum(h, square=True)
    assert s.dtype == torch.float32 and torch.allclose(s.double(), h.double().pow(2).sum(-1), rtol=1e-5)
    assert torch.equal(K.row_sum(h[9:10], square=True), s[9:10])
    assert K.row_sum(h, fp64=True).dtype == torch.float64
print("invariant kernels ok")
"""


def test_invariant_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "invariant kernels ok" in out.stdout, out.stderr[-3000:]


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
    from model.parallel.group import TPGroup
    from workers.shard_group import build_runner

    with pytest.raises(ValidationError, match="batch_invariant=true needs device=cuda"):
        AppArgs(device="cpu", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant needs device cuda"):
        build_runner(str(tiny_nemotron), TPGroup(), 2, 128, None, "cpu", batch_invariant=True)
