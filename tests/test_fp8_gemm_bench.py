"""benchmarks/fp8_gemm_bench.py runs on the GPU host only; off it, it says why instead of failing on CUDA."""
import pytest
import torch

from benchmarks.fp8_gemm_bench import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU host runs the benchmark itself")
def test_refuses_without_an_fp8_gpu():
    with pytest.raises(SystemExit, match="FP8 tensor cores"):
        main([])
