"""FP8 checkpoints under tensor parallelism (CPU, gloo): TP = 2 ranks of either family's FP8 model
against TP = 1, in fp64, over a prefill / denoise / commit schedule.

What TP = 1 to compare with: a row-parallel layer's input is split along K, and each rank rounds its
own slice of a token to FP8 with that slice's scale (as vLLM does: no collective for the scales), which
is finer than TP = 1's one scale per token. So TP = 2 is not TP = 1's FP8 model; it is TP = 1's twin
(compressed-tensors' decompression) whose quantized layers round their inputs with compressed-tensors:
per token where the input is whole on every rank (column-parallel layers: q/k/v, gate/up, the experts'
gate/up), per token and half of K where it is split (o_proj, down_proj, the experts' down). That it
must equal to fp64 rounding (tests/tp_harness.py's FP64_TOL): the ranks' shards of weights and scales,
the replicated KV heads of DiffusionGemma's full layers, the per-slice rounding and the all-reduces are
all in it. (In fp32 the ranks' different summation orders move a few activations across an FP8
rounding boundary, a whole FP8 step, so fp32 has no rounding-sized tolerance to test; fp64 does.)
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.loader import load_model
from model.parallel.group import TPGroup
from tests.fp8_reference import ct_activation_rounding, fp8_modules, schedule, twin_checkpoint
from tests.tp_harness import FP64_TOL, spawn_tp

WORLD = 2


def worker(rank: int, world_size: int, model_dirs: dict[str, str], out_dir: str) -> None:
    """Each family's fp64 schedule; and in fp32 its reference path and the FP8 kernels' path
    (tests/test_fp8_dispatch.py: the kernels' path under tensor parallelism, in the same ranks)."""
    from tests.test_fp8_dispatch import kernels_on_cpu

    tp = TPGroup.from_default_group()
    out = {family: schedule(load_model(d, tp, dtype=torch.float64, show_progress=False), tp)
           for family, d in model_dirs.items()}
    for family, d in model_dirs.items():
        net, calls = load_model(d, tp, show_progress=False), []
        reference = schedule(net, tp)
        with kernels_on_cpu(calls):
            kernels = schedule(net, tp)
        out[f"{family} kernels"] = {"reference": reference, "kernels": kernels, "calls": len(calls)}
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tiny_fp8_nemotron, tiny_fp8_gemma, tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8-tp")
    dirs = {"nemotron": str(tiny_fp8_nemotron), "gemma": str(tiny_fp8_gemma)}
    spawn_tp(worker, WORLD, work, dirs, str(work), timeout=240)
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_tp2_equals_tp1_with_each_ranks_rounding(ranks, family, tiny_fp8_nemotron, tiny_fp8_gemma, tmp_path):
    fp8_dir = {"nemotron": tiny_fp8_nemotron, "gemma": tiny_fp8_gemma}[family]
    twin = load_model(twin_checkpoint(fp8_dir, tmp_path / "twin"), dtype=torch.float64, show_progress=False)
    modules = fp8_modules(fp8_dir, twin)
    with ct_activation_rounding(twin, modules, tp=WORLD):
        expected = schedule(twin, TPGroup())
    tp1 = schedule(load_model(fp8_dir, dtype=torch.float64, show_progress=False), TPGroup())
    for r in ranks:
        for i, (got, want, one) in enumerate(zip(r[family], expected, tp1, strict=True)):
            d = (got - want).abs().max().item()
            assert d <= FP64_TOL, f"forward {i}: max |TP2 - TP1 with per-rank rounding| = {d:.3g}"
            # and the per-slice rounding is real: TP = 1's own FP8 model differs by FP8-sized amounts
            assert (got - one).abs().max() > 1e-4, f"forward {i}"


@pytest.mark.parametrize("family", ["nemotron", "gemma"])
def test_the_kernels_path_under_tensor_parallelism(ranks, family):
    """TP = 2: each rank's shards of FP8 weights and scales through the FP8 kernels' path (its own slice
    of a row-parallel layer's input quantized, the experts' intermediate dim split; CPU stand-ins for the
    kernels, tests/test_fp8_dispatch.py) give that rank's reference-path logits to fp32 rounding."""
    for rank, r in enumerate(ranks):
        got = r[f"{family} kernels"]
        assert got["calls"] > 0
        for i, (a, b) in enumerate(zip(got["kernels"], got["reference"], strict=True)):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), f"rank {rank} forward {i}"
