"""P5, tensor parallelism's speed-up, without the GPUs: which cases the roofline benchmark runs, when it
skips them, the all-reduce share of a profiled step, and the summary rows (benchmarks/roofline.py runs
the section when it sees more than one GPU).

  P5  per-forward time TP = 1 / TP = 2 at batch 1: Nemotron-LD 8B (canvas 32) and DiffusionGemma
      26B-A4B (canvas 256); the same at 16 requests (8B) and 4 canvases (26B-A4B); the all-reduce share
      of a TP = 2 step (NCCL and one-shot symmetric-memory kernels' time over all kernels').
"""
from __future__ import annotations

TP = 2
BATCHES = {"nemotron": (1, 16), "gemma": (1, 4)}
TARGET = ">= 1.7"
# kernels of a collective: NCCL's (ncclDevKernel_AllReduce_..., _AllGather_...) and the one-shot
# all-reduce over symmetric memory (one_shot_all_reduce_kernel)
ALLREDUCE_MARKS = ("nccl", "all_reduce", "allreduce")


def skip_reason(device_count: int) -> str | None:
    return None if device_count >= TP else f"needs {TP} GPUs, found {device_count}"


def allreduce_share(profile: dict) -> float:
    """The collectives' share of a profiled step's kernel time (benchmarks/roofline.py: profile_step)."""
    per_kernel = profile["per_kernel_ms"]
    total = sum(per_kernel.values())
    collective = sum(ms for name, ms in per_kernel.items() if any(m in name.lower() for m in ALLREDUCE_MARKS))
    return collective / total if total else 0.0


def speedups(p5: dict) -> dict:
    """{family: {batch: TP = 1 step time / TP = 2 step time}} of the section's measurements."""
    return {family: {b: rows["tp1"][str(b)] / rows[f"tp{TP}"][str(b)] for b in BATCHES[family]}
            for family, rows in p5.items() if family in BATCHES and "tp1" in rows and f"tp{TP}" in rows}


def rows(r: dict) -> list[tuple[str, float | None, str]]:
    """The summary rows: each ratio, or '-' where the section did not run (its reason in the JSON)."""
    p5 = r.get("P5") or {}
    got = speedups(p5)
    names = {"nemotron": ("8B", "batch 1", "batch 16"), "gemma": ("26B-A4B", "1 canvas", "4 canvases")}
    out = []
    for family, (model, *labels) in names.items():
        for b, label in zip(BATCHES[family], labels):
            out.append((f"P5 TP=1 / TP=2 step time, {model} {label}", got.get(family, {}).get(b), TARGET))
        share = (p5.get(family) or {}).get("allreduce_share")
        out.append((f"P5 all-reduce share of a TP=2 step, {model} batch 1", share, "report"))
    return out
