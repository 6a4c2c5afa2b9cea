"""benchmarks/step_bound.py: the full-size shapes counted right, and each part of the bound the larger of
its bytes over the bandwidth and its FLOPs over the rate."""
import pytest

from benchmarks.step_bound import bound, shape_of


@pytest.fixture(scope="module")
def shapes():
    return {f: shape_of(f) for f in ("nemotron-ld", "diffusion-gemma")}


def test_the_shapes_are_counted_from_the_published_configs(shapes):
    nem, dg = shapes["nemotron-ld"], shapes["diffusion-gemma"]
    # Ministral-3 8B: 34 layers of qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336
    assert nem.dense == 34 * (6144 + 4096 + 28672 + 14336) * 4096 and nem.experts == 0 and nem.head_reads == 1
    assert (nem.canvas, nem.vocab, nem.hidden) == (32, 131072, 4096)
    # the 26B-A4B: 30 layers of 128 experts, gate_up 1408 x 2816 and down 2816 x 704; top 8
    assert dg.experts == 30 * 128 * (1408 * 2816 + 2816 * 704) and (dg.num_experts, dg.top_k) == (128, 8)
    assert (dg.canvas, dg.vocab, dg.hidden, dg.head_reads) == (256, 262144, 2816, 2)
    assert len(dg.layers) == 30 and {w for *_, w, _ in dg.layers} == {None, 1024}
    assert all(k_is_v == (w is None) for *_, w, k_is_v in dg.layers)   # full layers: values are their keys


def test_each_part_is_the_larger_of_its_reads_and_its_compute(shapes):
    nem, dg = shapes["nemotron-ld"], shapes["diffusion-gemma"]
    one = bound(nem, 1, keys=2048, tflops=750, tbps=4.3)
    assert one["dense"] == pytest.approx(nem.dense * 2 / 4.3e12)                   # 32 tokens: a weight read
    many = bound(nem, 64, keys=2048, tflops=750, tbps=4.3)
    assert many["dense"] == pytest.approx(2 * nem.dense * 64 * 32 / 750e12)        # 2048 tokens: compute
    assert bound(nem, 1, 2048, fp8=True)["dense"] == pytest.approx(one["dense"] / 2)   # one byte a weight
    # the lone canvas reads every expert; its head and self-conditioning GEMMs (V x H each, 256 tokens) are
    # compute-bound already, and stay in BF16 with FP8 weights elsewhere
    lone = bound(dg, 1, keys=2048, tflops=750, tbps=4.3)
    assert lone["experts"] == pytest.approx(dg.experts * 2 / 4.3e12, rel=1e-6)
    assert lone["head"] == pytest.approx(2 * 2 * 262144 * 2816 * 256 / 750e12)
    assert bound(dg, 1, 2048, fp8=True, tflops=750, tbps=4.3)["head"] == lone["head"]
    assert lone["step"] == pytest.approx(sum(v for k, v in lone.items() if k != "step"))


def test_batching_gains_at_most_the_rows(shapes):
    for shape in shapes.values():
        steps = [bound(shape, b, 2048)["step"] for b in (1, 2, 4, 8, 16)]
        assert steps == sorted(steps)
        assert all(b * steps[0] / s <= b for b, s in zip((1, 2, 4, 8, 16), steps))
        assert bound(shape, 1, 2048, fp8=True)["step"] < steps[0]
