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


def test_the_experts_best_pair_keeps_one_tile_height():
    """The served experts take one tile height for both projections (the routing's one tile map): the best
    pair is the least sum among same-height tiles, not the two fastest tiles (this H200's 2026-12-06 figures
    at 256 tokens: the fastest gate_up is 32 rows high and the fastest down 16)."""
    us = lambda v: {"us": v}  # noqa: E731
    result = {"gate_up_t256": {"floor_us": 120.3, "(64, 128, 128, 4, 4)": us(133.8), "(64, 128, 64, 4, 5)": "failed",
                               "(32, 64, 256, 4, 3, True)": us(128.6), "(16, 64, 128, 4, 4, True)": us(132.7)},
              "down_t256": {"floor_us": 60.2, "(64, 128, 128, 4, 4)": us(81.7), "(32, 64, 256, 4, 3, True)": us(82.7),
                            "(16, 64, 128, 4, 4, True)": us(78.0)}}
    assert fp8_experts_bench.best_pair(result, 256) == ("(16, 64, 128, 4, 4, True)", "(16, 64, 128, 4, 4, True)",
                                                         132.7 + 78.0)
    result["down_t256"]["(16, 64, 128, 4, 4, True)"] = us(90.0)
    assert fp8_experts_bench.best_pair(result, 256)[:2] == ("(32, 64, 256, 4, 3, True)", "(32, 64, 256, 4, 3, True)")


def test_the_experts_sweep_times_the_served_tiles_first():
    """The bench's "served" column is the served experts' kernel: their tiles over the chunked weight."""
    from model.kernels.fp8 import EXPERT_TILES

    assert fp8_experts_bench.CHUNKED_SWEEP[0] == tuple(EXPERT_TILES.gate_up)[:5] == tuple(EXPERT_TILES.down)[:5]
    assert fp8_experts_bench.SERVED == f"{fp8_experts_bench.CHUNKED_SWEEP[0]} chunked"
    assert not EXPERT_TILES.gate_up.swap
