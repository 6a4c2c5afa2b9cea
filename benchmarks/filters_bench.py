"""Times the filters' thresholds (model/kernels/filters.py triton_threshold) on CUDA and checks them
against model.sampling.filters.torch_threshold on the same input (allclose rtol 1e-6, the same -inf rows):
DiffusionGemma canvases and Nemotron blocks (SHAPES) under each of ASKS (`traffic`: each row's options
drawn from the built-in mix, what a served step of the mixed phase carries). --against FILE times another
version of the kernel's module beside it on the same inputs (e.g. an older commit's filters.py), --sweep
its module constants (SWEEP), --profile its kernels in launch order, --tiny small shapes (also on the CPU
under TRITON_INTERPRET=1). Prints a table; writes JSON to --json. docs/benchmarking.md says more.

    PYTHONPATH=. python benchmarks/filters_bench.py [--sweep] [--profile] [--against FILE] [--json FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

import model.kernels.filters as F
from benchmarks.request_mix import load_mix
from model.kernels.filters import triton_threshold
from model.kernels.launch import INTERPRETED
from model.parallel.group import TPGroup
from model.sampling.filters import torch_threshold

DG = dict(softcap=30.0, on_scaled=False)
NEMOTRON = dict(on_scaled=True)
SHAPES = {   # name: (shape, dtype, how filters are decided)
    "dg1": ((1, 256, 262144), torch.bfloat16, DG),
    "dg4": ((4, 256, 262144), torch.bfloat16, DG),
    "dg8": ((8, 256, 262144), torch.bfloat16, DG),
    "nem8_fp32": ((8, 32, 131072), torch.float32, NEMOTRON),
    "nem16_fp32": ((16, 32, 131072), torch.float32, NEMOTRON),
    "nem8_bf16": ((8, 32, 131072), torch.bfloat16, NEMOTRON),
    "nem16_bf16": ((16, 32, 131072), torch.bfloat16, NEMOTRON),
}
TINY = {   # --tiny: the same kinds, small enough for the interpreter
    "dg_tiny": ((2, 4, 5000), torch.bfloat16, DG),
    "nem_tiny_fp32": ((3, 2, 3000), torch.float32, NEMOTRON),
    "dg_tiny_rows": ((8, 1, 12288), torch.bfloat16, DG),   # 8 rows of the traffic ask, k below the tiles
}
ASKS = ("mixed", "k40p0.9", "p0.9", "none", "traffic")
# --sweep: settings of the kernel's module constants, each on top of its defaults (the first: none)
SETTINGS = ("SPLIT", "COUNT_BLOCK", "MASS_BLOCK", "CACHE_TILE", "NUM_WARPS")
SWEEP = [{}, {"COUNT_BLOCK": 1024}, {"SPLIT": 8192}, {"SPLIT": 32768}, {"MASS_BLOCK": 256, "CACHE_TILE": 256},
         {"NUM_WARPS": 8}]
SWEEP_CASES = [("dg8", "traffic"), ("dg8", "mixed"), ("dg8", "p0.9"), ("dg1", "traffic"), ("nem16_bf16", "traffic"),
               ("nem16_fp32", "traffic")]


def asks(name: str, R: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p), each [R], of an ask in ASKS."""
    r = torch.arange(R)
    if name == "mixed":
        temp = torch.tensor([1.0, 0.7, 0.0])[r // 3 % 3]
        top_k = torch.tensor([40, 0, 499, 1, 17, 5, 100])[r % 7]
        top_p = torch.tensor([0.9, 1.0, 0.5])[r % 3]
    elif name == "traffic":
        draws = [d.options for d in load_mix("diffusion-gemma").draw(R, np.random.default_rng(0))]
        temp = torch.tensor([float(d.get("temperature", 1.0)) for d in draws])
        top_k = torch.tensor([int(d.get("top_k", 0)) for d in draws])
        top_p = torch.tensor([float(d.get("top_p", 1.0)) for d in draws])
    elif name in ("k40p0.9", "p0.9", "none"):
        temp = torch.ones(R)
        top_k = torch.full((R,), 40 if name == "k40p0.9" else 0)
        top_p = torch.full((R,), 1.0 if name == "none" else 0.9)
    else:
        raise ValueError(f"unknown ask {name!r}: one of {ASKS}")
    return temp.to(device), top_k.to(device), top_p.to(device)


def logits(shape, dtype, device, seed=0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=device) * 3
    x[:, :, 0] = -torch.inf   # a mask token
    return x.to(dtype)


def time_ms(fn, iters: int, device) -> float:
    """Median milliseconds of fn() over iters runs after one warm-up (compiles)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def launch_profile(fn, runs: int = 3) -> dict:
    """The CUDA kernels of one eager fn() in launch order, each with its device time (the median of runs,
    us), and the call's busy and span time. span - busy is the GPU idling between the eager launches,
    the profiler's own overhead included (so an upper bound; a CUDA graph's replay idles far less). The
    thresholds launch, in order: the tile maxima, the top-k bound, the count passes (4
    for bf16 logits, 8 for fp32), the top-k logit, the mass passes (the normaliser's torch ops after the
    first), the finish."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    seen = []
    for _ in range(runs):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        seen.append([(e.name, e.time_range.start, e.time_range.end) for e in kernels])
    names = [name for name, _, _ in seen[0]]
    if any([name for name, _, _ in run] != names for run in seen):
        raise RuntimeError("the kernels launched differ between runs: " + str([len(run) for run in seen]))
    us = [statistics.median(run[i][2] - run[i][1] for run in seen) for i in range(len(names))]
    span = statistics.median(run[-1][2] - run[0][1] for run in seen) if names else 0.0
    return {"kernels": [{"kernel": name[:80], "us": t} for name, t in zip(names, us)], "busy_us": sum(us),
            "span_us": span}


def show_profile(label: str, prof: dict) -> None:
    """One line of launch_profile's kernels: short names and microseconds, in launch order."""
    shown = ", ".join(f"{k['kernel'].removeprefix('_').split('(')[0][:24]} {k['us']:.0f}" for k in prof["kernels"])
    print(f"  {label}: busy {prof['busy_us']:.0f} us of a {prof['span_us']:.0f} us span: {shown}", flush=True)


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """(exact by the tests' rule, the largest relative difference of the finite thresholds)."""
    same_inf = torch.equal(torch.isinf(a), torch.isinf(b))
    finite = torch.isfinite(a) & torch.isfinite(b)
    rel = ((a - b).abs() / a.abs().clamp(min=1e-30))[finite]
    worst = rel.max().item() if rel.numel() else 0.0
    return same_inf and torch.allclose(a, b, rtol=1e-6, atol=0, equal_nan=True), worst


def graph_replays_equal(x, temp, top_k, top_p, kw) -> bool:
    """The thresholds captured in a CUDA graph (no host syncs, static shapes) replay to the eager ones."""
    eager = triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(out, eager)


def load_against(path: Path):
    """The filters module at path (another version of model/kernels/filters.py), imported under its own
    name so that it and its triton kernels live beside the current ones."""
    spec = importlib.util.spec_from_file_location("filters_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against {path}: not a python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "triton_threshold"):
        raise SystemExit(f"--against {path}: has no triton_threshold")
    return module


def run_case(name, ask, shape, dtype, kw, device, opts, against=None) -> dict:
    x = logits(shape, dtype, device)
    temp, top_k, top_p = asks(ask, shape[0], device)
    row = dict(shape=name, dims=list(shape), dtype=str(dtype).removeprefix("torch."), ask=ask)
    new = lambda: triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)   # noqa: E731
    row["new_ms"] = time_ms(new, opts.iters, device)
    if against is not None:
        old = lambda: against.triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)   # noqa: E731
        row["against_ms"] = time_ms(old, opts.iters, device)
        row["speedup"] = row["against_ms"] / row["new_ms"]
    if opts.profile and device.type == "cuda":
        row["profile"] = launch_profile(new)
        if against is not None:
            row["against_profile"] = launch_profile(old)
    if opts.check:
        ref = torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
        exact, worst = compare(ref, new())
        row.update(exact=exact, max_rel_diff=worst)
        if against is not None:
            row["against_exact"], row["against_max_rel_diff"] = compare(ref, old())
    return row


def settings() -> dict:
    return {name.lower(): getattr(F, name) for name in SETTINGS}


def sweep(table, device, opts) -> list[dict]:
    rows, saved = [], {name: getattr(F, name) for name in SETTINGS}
    try:
        for setting in SWEEP:
            for name, value in (saved | setting).items():
                setattr(F, name, value)
            cases = SWEEP_CASES if table is SHAPES else [(name, opts.asks[0]) for name in opts.shapes or table]
            for name, ask in cases:
                shape, dtype, kw = table[name]
                x = logits(shape, dtype, device)
                temp, top_k, top_p = asks(ask, shape[0], device)
                ms = time_ms(lambda: triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw), opts.iters, device)
                row = settings() | dict(shape=name, ask=ask, new_ms=ms)
                if opts.check:
                    ref = torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
                    row["exact"] = compare(ref, triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw))[0]
                rows.append(row)
                shown = (f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                print("sweep " + "  ".join(shown), flush=True)
    finally:
        for name, value in saved.items():
            setattr(F, name, value)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", help=f"of {list(SHAPES)} (default: all; with --tiny, of {list(TINY)})")
    p.add_argument("--asks", nargs="+", default=list(ASKS), choices=ASKS)
    p.add_argument("--iters", type=int, default=5, help="timed runs a case (the median is reported)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check against torch")
    p.add_argument("--sweep", action="store_true", help="also time the new kernel's SWEEP settings")
    p.add_argument("--profile", action="store_true",
                   help="also list each case's kernels in launch order with their device times (CUDA only)")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU: under TRITON_INTERPRET=1 only)")
    p.add_argument("--against", type=Path, metavar="FILE",
                   help="another filters module (a copy of model/kernels/filters.py) to time beside this one")
    p.add_argument("--json", type=Path, help="where the JSON goes (default: $OUT/filters_bench.json if $OUT)")
    opts = p.parse_args(argv)
    table = TINY if opts.tiny else SHAPES
    unknown = sorted(set(opts.shapes or []) - set(table))
    if unknown:
        p.error(f"unknown shapes {unknown}: one of {list(table)}")
    if opts.iters < 1:
        p.error("--iters must be at least 1")
    if opts.against is not None and not opts.against.is_file():
        p.error(f"--against {opts.against}: no such file")
    if opts.json is None and os.environ.get("OUT"):
        opts.json = Path(os.environ["OUT"]) / "filters_bench.json"
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    table = TINY if opts.tiny else SHAPES
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif opts.tiny and INTERPRETED:
        device = torch.device("cpu")
    else:
        sys.exit("filters_bench needs a CUDA device (or --tiny under TRITON_INTERPRET=1)")
    against = None if opts.against is None else load_against(opts.against)
    if opts.profile and device.type != "cuda":
        print("--profile: no CUDA device, so no kernels to list (the interpreter runs none)", flush=True)
    rows = []
    beside = f"{'against_ms':>11}{'speedup':>8}  against exact" if against else ""
    print(f"{'shape':<14}{'dtype':<10}{'ask':<9}{'ms':>9}  exact  max rel diff{beside}", flush=True)
    for name in opts.shapes or list(table):
        shape, dtype, kw = table[name]
        for ask in opts.asks:
            row = run_case(name, ask, shape, dtype, kw, device, opts, against)
            rows.append(row)
            beside = (f"    {row['against_ms']:>11.3f}{row['speedup']:>8.2f}  {row.get('against_exact', '-')}"
                      if against else "")
            print(f"{name:<14}{row['dtype']:<10}{ask:<9}{row['new_ms']:>9.3f}"
                  f"  {str(row.get('exact', '-')):<5}  {row.get('max_rel_diff', float('nan')):.2e}{beside}", flush=True)
            for label in ("profile", "against_profile"):
                if label in row:
                    show_profile(label.replace("_", " "), row[label])
    report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__,
                  settings=settings(), cases=rows,
                  against=None if opts.against is None else str(opts.against))
    if device.type == "cuda":
        shape, dtype, kw = table[next(iter(table))]
        x = logits(shape, dtype, device)
        report["graph_replay_equal"] = graph_replays_equal(x, *asks("mixed", shape[0], device), kw)
        print(f"CUDA graph replay equals eager: {report['graph_replay_equal']}", flush=True)
        del x
    if opts.sweep:
        report["sweep"] = sweep(table, device, opts)
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {opts.json}")
    failed = [r for r in rows + report.get("sweep", []) if False in (r.get("exact"), r.get("against_exact"))]
    if failed or report.get("graph_replay_equal") is False:
        graph = "; graph replay differs" if report.get("graph_replay_equal") is False else ""
        print(f"NOT EXACT: {len(failed)} case(s){graph}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
