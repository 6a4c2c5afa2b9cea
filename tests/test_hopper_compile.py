"""Every triton kernel compiles for an H200, and fits it, on a machine without a GPU (tests/hopper.py):
the calls tests/hopper_kernels.py --quick makes, at the served models' full-size shapes. A kernel the
interpreter runs but the compiler rejects, tiles that ask for more shared memory than the H200 has,
registers spilled to local memory, or a matmul that lost Hopper's tensor-core instructions fail here
instead of in a GPU session."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_compiles_for_the_h200_and_fits_it(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    report = tmp_path / "census.json"
    out = subprocess.run([sys.executable, "-m", "tests.hopper_kernels", "--quick", "--json", str(report)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert report.is_file(), out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert not result["failures"], "\n".join(result["failures"])
    assert out.returncode == 0, out.stderr[-3000:]
    # a kernel the census never calls would go to its first GPU session uncompiled
    assert sorted(result["kernels"]) == result["defined"]
    kernels = result["kernels"]
    for name, k in kernels.items():
        assert k["shared"] <= result["max_shared"], (name, k)
        assert k["spilled"] == 0, f"{name} spills {k['spilled']} bytes a thread to local memory"
    # the matmuls run on Hopper's warpgroup tensor cores (wgmma): FP8 operands as FP8 (e4m3), not
    # upcast; every bf16 attention tile on tensor cores of some kind
    for name in ("_matmul_kernel", "_grouped_kernel"):
        assert kernels[name]["mma"]["*fp8e4nv"] == ["wgmma.e4m3"], (name, kernels[name]["mma"])
        assert kernels[name]["mma"]["*bf16"] == ["wgmma.bf16"], (name, kernels[name]["mma"])
    assert "none" not in kernels["_attn_kernel"]["mma"]["*bf16"], kernels["_attn_kernel"]["mma"]
    # attention's key loop is pipelined wherever its tiles ask for stages (a loop body under an `if`,
    # as the interpreter's loop has, compiles to synchronous loads)
    assert kernels["_attn_kernel"]["staged_unpipelined"] == 0, kernels["_attn_kernel"]
    # the experts' sort takes its sizes as values: token counts past every graph's (an eager prefill of
    # several long prompts) compile nothing the warm-up did not (--quick builds one family with experts,
    # DiffusionGemma's full-size shapes: one expert count)
    from model.kernels import fp8, invariant
    assert kernels["_count_kernel"]["specializations"] == 1, kernels["_count_kernel"]
    heights = len({invariant.GROUPED_TILES.m, fp8.EXPERT_TILES.m})
    assert kernels["_place_kernel"]["specializations"] == heights, kernels["_place_kernel"]
