"""The roofline benchmark's CPU-side arithmetic (the benchmark itself needs a GPU: `make bench`)."""
from benchmarks.roofline import profile_difference


def test_profile_difference_ranks_kernels_by_their_change_and_sums_all():
    with_sc = {"per_kernel_ms": {"gemm_pw": 0.49, "experts": 11.9, "norm": 0.50, "scale": 0.01}}
    without = {"per_kernel_ms": {"experts": 11.7, "norm": 0.50, "gather": 0.02}}
    rows = profile_difference(with_sc, without, top=3)
    assert [r["name"] for r in rows] == ["gemm_pw", "experts", "gather", "all"]
    assert [r["ms"] for r in rows[:3]] == [0.49, 0.2, -0.02]
    assert abs(rows[-1]["ms"] - (0.49 + 0.2 - 0.02 + 0.01)) < 1e-9


def test_tp_section_records_its_skip_without_two_gpus(tmp_path, monkeypatch):
    import torch

    from benchmarks import roofline, tp_bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = {}
    roofline.tensor_parallel(tmp_path, result, set())
    assert result == {"P5": {"skipped": "needs 2 GPUs, found 1"}}
    lines = [line for line in roofline.summary(result).splitlines() if line.startswith("P5")]
    assert len(lines) == 6 and all(line.endswith(("-  >= 1.7", "-  report")) for line in lines)   # '-': not run
    assert tp_bench.skip_reason(2) is None and tp_bench.skip_reason(4) is None


def test_tp_speedups_and_allreduce_share():
    from benchmarks import tp_bench

    profile = {"per_kernel_ms": {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": 0.5,
                                 "void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>": 1.0,
                                 "ncclDevKernel_AllGather_RING_LL": 0.5, "nvjet_hsh_128x256_gemm": 7.0,
                                 "triton_red_fused_rms_norm_0": 1.0}}
    assert abs(tp_bench.allreduce_share(profile) - 0.2) < 1e-12
    assert tp_bench.allreduce_share({"per_kernel_ms": {}}) == 0.0
    p5 = {"nemotron": {"tp1": {"1": 6.0, "16": 9.0}, "tp2": {"1": 4.0, "16": 5.0}, "allreduce_share": 0.25},
          "gemma": {"tp1": {"1": 10.0, "4": 20.0}}}   # its TP = 2 ranks failed: no ratio
    assert tp_bench.speedups(p5) == {"nemotron": {1: 1.5, 16: 1.8}}
    rows = {name: value for name, value, _ in tp_bench.rows({"P5": p5})}
    assert rows["P5 TP=1 / TP=2 step time, 8B batch 1"] == 1.5
    assert rows["P5 TP=1 / TP=2 step time, 8B batch 16"] == 1.8
    assert rows["P5 all-reduce share of a TP=2 step, 8B batch 1"] == 0.25
    assert rows["P5 TP=1 / TP=2 step time, 26B-A4B 1 canvas"] is None


def test_skip_selects_sections():
    """`--skip bf16,nemotron,...` runs DiffusionGemma's FP8 rows alone (a short GPU call); a family's name
    skips its rows everywhere, the FP8 traffic row with DiffusionGemma's."""
    from benchmarks.roofline import sections

    assert sections(set()) == (["nemotron", "gemma", "fp8", "tp"], ["nemotron", "gemma", "fp8"])
    assert sections({"bf16", "nemotron", "traffic", "tp"}) == (["fp8"], [])
    assert sections({"bf16", "nemotron", "tp"}) == (["fp8"], ["fp8"])
    assert sections({"gemma"}) == (["nemotron", "fp8", "tp"], ["nemotron"])
    assert sections({"fp8", "traffic"}) == (["nemotron", "gemma", "tp"], [])
