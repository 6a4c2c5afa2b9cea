"""The small-message all-reduce path (model/parallel/small_allreduce.py) on CPU: which path a group and a
message take (pure functions), the multicast-off environment, and over gloo at TP = 2 that the TPGroup
interface gives what dist.all_reduce gives, with the plain path and with the one-shot path's plumbing
(copy in, reduce into x or a scratch copied back, no allocation) driven by a gloo stand-in for the
CUDA kernel. The kernel itself runs only on CUDA (tests/test_tp_gpu.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model.parallel import small_allreduce as S
from model.parallel.group import TPGroup
from tests.test_diffusion_gemma_tp import Allocations
from tests.tp_harness import spawn_tp

SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN
KIB = 1024


@pytest.mark.parametrize("device, backend, world, enabled, missing, why", [
    ("cuda", "nccl", 2, True, None, None),
    ("cuda", "nccl", 4, True, None, None),
    ("cuda", "nccl", 8, True, None, None),
    ("cuda", "nccl", 1, True, None, "world size 1"),
    ("cuda", "nccl", 2, False, None, "DLLM_SMALL_ALLREDUCE=0"),
    ("cpu", "gloo", 2, True, None, "cpu/gloo"),
    ("cuda", "gloo", 2, True, None, "cuda/gloo"),
    ("cuda", "nccl", 3, True, None, "world size 3"),
    ("cuda", "nccl", 2, True, "torch has no symmetric-memory", "torch has no symmetric-memory"),
])
def test_group_path(device, backend, world, enabled, missing, why):
    got = S.group_path(device, backend, world, enabled, missing)
    assert got is None if why is None else why in got


@pytest.mark.parametrize("nbytes, dtype, op, expected", [
    (4096 * 32 * 2, torch.bfloat16, SUM, True),     # the 8B's batch-1 hidden state
    (2816 * 256 * 2, torch.bfloat16, SUM, True),    # the 26B-A4B's
    (2 << 20, torch.float32, SUM, True),            # exactly the buffer
    ((2 << 20) + 4, torch.float32, SUM, False),     # one element more
    (4096 * 32 * 16 * 2, torch.bfloat16, SUM, False),   # batch 16: NCCL
    (4096, torch.bfloat16, MAX, False),             # the kernel sums only
    (4096, torch.float32, MIN, False),
    (4096, torch.float64, SUM, False),              # fp64 reference runs, int64 counts: NCCL
    (4096, torch.int64, SUM, False),
    (4096, torch.float16, SUM, False),
    (6, torch.bfloat16, SUM, False),                # 3 elements: not a whole 4-byte vector
    (4, torch.bfloat16, SUM, True),
    (0, torch.float32, SUM, False),
])
def test_takes(nbytes, dtype, op, expected):
    assert S.takes(nbytes, dtype, op, S.DEFAULT_MAX_BYTES) is expected


def test_multicast_off_overrides_what_was_set():
    env = {"NCCL_NVLS_ENABLE": "1", "OTHER": "x"}
    S.disable_multicast(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                   "OTHER": "x"}


def test_switch_and_size_from_env():
    assert S.enabled_by_env({}) and S.enabled_by_env({S.ENABLE_ENV: "1"})
    assert not S.enabled_by_env({S.ENABLE_ENV: "0"})
    assert S.max_bytes_from_env({}) == S.DEFAULT_MAX_BYTES
    assert S.max_bytes_from_env({S.BYTES_ENV: "65536"}) == 65536
    for bad in ("64k", "-16", "100"):
        with pytest.raises(ValueError, match=S.BYTES_ENV):
            S.max_bytes_from_env({S.BYTES_ENV: bad})


def test_no_cuda_here_means_no_symmetric_memory():
    if torch.cuda.is_available():
        pytest.skip("a CUDA host")
    assert S.symm_mem_missing() == "no CUDA device"


# --------------------------------------------------------------------------------------------------
# Over gloo, TP = 2

def _messages(rank: int) -> list[tuple[str, torch.Tensor, dist.ReduceOp]]:
    """Each rank's different values; the cases the callers pass: contiguous, a row of a matrix (a view
    at an offset), a transposed (non-contiguous) view, a stacked pair, integer counts, maxima."""
    gen = torch.Generator().manual_seed(100 + rank)
    big = torch.randn(5, 33, generator=gen)
    return [
        ("fp32", torch.randn(4, 64, generator=gen), SUM),
        ("bf16", torch.randn(3, 32, generator=gen).bfloat16(), SUM),
        ("row at an offset", big[1], SUM),
        ("transposed", big[:, :32].t(), SUM),
        ("stacked", torch.stack([torch.randn(8, generator=gen), torch.randn(8, generator=gen)]), SUM),
        ("counts", torch.randint(0, 100, (7,), generator=gen), SUM),
        ("max", torch.randn(4, 9, generator=gen), MAX),
        ("fp64", torch.randn(5, generator=gen, dtype=torch.float64), SUM),
    ]


def _gloo_reduce_out(part: torch.Tensor, reduce_op: str, group_name: str, out: torch.Tensor) -> torch.Tensor:
    """What the CUDA kernel does, over gloo: every rank's `part` summed into `out` (part is left alone)."""
    assert reduce_op == "sum" and group_name == dist.group.WORLD.group_name
    assert part.is_contiguous() and out.is_contiguous() and out.shape == part.shape
    out.copy_(part)
    dist.all_reduce(out)
    _gloo_reduce_out.calls += 1
    return out


def interface_worker(rank: int, world_size: int) -> None:
    plain = TPGroup.from_default_group("cpu")
    assert plain.small is None   # gloo: the plain path
    fast = TPGroup(rank, world_size, dist.group.WORLD,
                   small=S.OneShotAllReduce(torch.empty(4 * KIB, dtype=torch.uint8),
                                            torch.empty(4 * KIB, dtype=torch.uint8),
                                            dist.group.WORLD.group_name, _gloo_reduce_out))
    for name, x, op in _messages(rank):
        expected = x.clone()
        dist.all_reduce(expected, op=op)
        for tp in (plain, fast):
            y = x.clone() if x.is_contiguous() else x.clone().t().contiguous().t()   # same layout
            base = y.untyped_storage().data_ptr()
            _gloo_reduce_out.calls = 0
            with Allocations() as alloc:
                out = tp.all_reduce(y, op)
            assert out is y and y.untyped_storage().data_ptr() == base, f"{name}: not in place"
            assert torch.equal(y, expected), f"{name} ({'one-shot' if tp.small else 'plain'}): {y} != {expected}"
            if tp.small is not None:
                used = tp.small.takes(x, op)
                assert _gloo_reduce_out.calls == int(used), name
                assert used == (name in ("fp32", "bf16", "row at an offset", "transposed", "stacked")), name
                assert not used or not alloc.shapes, f"{name}: the one-shot path allocated {alloc.shapes}"
    # the row at an offset (4 bytes past an aligned start) and the transposed view take the scratch
    # buffer; an aligned contiguous x is written by the kernel itself: the scratch keeps its old bytes
    fast.small.scratch.fill_(7)
    fast.all_reduce(torch.ones(16))
    assert (fast.small.scratch == 7).all()
    fast.all_reduce(torch.ones(17)[1:])
    assert not (fast.small.scratch[:64] == 7).all()


def test_tp2_over_gloo_interface_equals_all_reduce(tmp_path):
    spawn_tp(interface_worker, 2, tmp_path, timeout=120)
