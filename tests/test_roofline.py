"""The roofline benchmark's CPU-side arithmetic (the benchmark itself needs a GPU: `make bench`)."""
from benchmarks.roofline import profile_difference


def test_profile_difference_ranks_kernels_by_their_change_and_sums_all():
    with_sc = {"per_kernel_ms": {"gemm_pw": 0.49, "experts": 11.9, "norm": 0.50, "scale": 0.01}}
    without = {"per_kernel_ms": {"experts": 11.7, "norm": 0.50, "gather": 0.02}}
    rows = profile_difference(with_sc, without, top=3)
    assert [r["name"] for r in rows] == ["gemm_pw", "experts", "gather", "all"]
    assert [r["ms"] for r in rows[:3]] == [0.49, 0.2, -0.02]
    assert abs(rows[-1]["ms"] - (0.49 + 0.2 - 0.02 + 0.01)) < 1e-9
