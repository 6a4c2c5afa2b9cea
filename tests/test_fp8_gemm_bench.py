"""The FP8 kernel benchmarks run on the GPU host only; off it, they say why instead of failing on CUDA."""
import pytest
import torch

from benchmarks import fp8_experts_bench, fp8_gemm_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU host runs the benchmarks themselves")
@pytest.mark.parametrize("bench, argv", [(fp8_gemm_bench, []), (fp8_gemm_bench, ["--family", "diffusion-gemma"]),
                                         (fp8_experts_bench, [])], ids=["gemm", "gemm-dg", "experts"])
def test_refuses_without_an_fp8_gpu(bench, argv):
    with pytest.raises(SystemExit, match="FP8 tensor cores"):
        bench.main(argv)


def test_the_diffusion_gemma_shapes_are_its_layers():
    """The DG rows time the dense projections the served model holds: qkv (16 q heads and 8 K, V heads of
    256; the full layers 16 heads of 512 and one K = V pair), o, the dense MLP's gate_up and down."""
    from benchmarks.shapes import DIFFUSION_GEMMA_26B_A4B_TEXT as c

    shapes, rows = fp8_gemm_bench.SHAPES["diffusion-gemma"]
    h, d, dg = c["hidden_size"], c["head_dim"], c["global_head_dim"]
    assert shapes["qkv"] == ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, h)
    assert shapes["qkv_full"] == ((c["num_attention_heads"] + c["num_global_key_value_heads"]) * dg, h)
    assert shapes["o"] == (h, c["num_attention_heads"] * d) and shapes["o_full"] == (h, c["num_attention_heads"] * dg)
    assert shapes["gate_up"] == (2 * c["intermediate_size"], h) and shapes["down"] == (h, c["intermediate_size"])
    assert fp8_experts_bench.HIDDEN == h and fp8_experts_bench.INTERMEDIATE == c["moe_intermediate_size"]
    assert (fp8_experts_bench.E, fp8_experts_bench.TOP_K) == (c["num_experts"], c["top_k_experts"])
