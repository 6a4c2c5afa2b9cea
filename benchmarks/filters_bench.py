"""Times the filters' thresholds (model/kernels/filters.py triton_threshold) on CUDA and checks them
against model.sampling.filters.torch_threshold on the same input (allclose rtol 1e-6, the same -inf rows).

Shapes: DiffusionGemma canvases [R, 256, 262144] bf16 (softcap 30, decided before the temperature) and
Nemotron blocks [R, 32, 131072] in fp32 and bf16 (decided on x / T). Each shape runs four asks:

    mixed    row r: top_k (40, 0, 499, 1, 17, 5, 100)[r % 7], top_p (0.9, 1, 0.5)[r % 3],
             temperature (1, 0.7, 0)[r // 3 % 3]
    k40p0.9  every row top_k 40 and top_p 0.9
    p0.9     every row top_p 0.9 alone (the whole vocabulary carries mass)
    none     no row asks a filter

The baseline is the kernel this one replaced (16 comparisons an entry and pass, candidates along the
tile's last axis), kept below verbatim but renamed. --sweep times a few tile / split settings of the
new kernel. --tiny runs small shapes, also on the CPU under TRITON_INTERPRET=1 (a smoke test of this
script). Prints a table; writes JSON to --json (default $OUT/filters_bench.json when $OUT is set).

    PYTHONPATH=. python benchmarks/filters_bench.py [--sweep] [--no-baseline]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import model.kernels.filters as F
from model.kernels.filters import COUNT, LOG_NORM, MASS, decided_value, triton_threshold
from model.kernels.launch import INTERPRETED
from model.parallel.group import TPGroup
from model.sampling.filters import CANDIDATES, torch_threshold

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
}
ASKS = ("mixed", "k40p0.9", "p0.9", "none")
# --sweep: (SPLIT, COUNT_BLOCK, MASS_BLOCK, NUM_WARPS, HISTOGRAM) of the new kernel
SWEEP = [(16384, 2048, 512, 4, True), (16384, 4096, 512, 8, True), (16384, 1024, 256, 4, True),
         (8192, 2048, 512, 4, True), (32768, 2048, 512, 4, True), (16384, 2048, 512, 4, False),
         (16384, 2048, 1024, 8, True)]
SWEEP_CASES = [("dg8", "mixed"), ("dg8", "p0.9"), ("nem16_fp32", "mixed")]


def asks(name: str, R: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p), each [R], of an ask in ASKS."""
    r = torch.arange(R)
    if name == "mixed":
        temp = torch.tensor([1.0, 0.7, 0.0])[r // 3 % 3]
        top_k = torch.tensor([40, 0, 499, 1, 17, 5, 100])[r % 7]
        top_p = torch.tensor([0.9, 1.0, 0.5])[r % 3]
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


def run_case(name, ask, shape, dtype, kw, device, opts) -> dict:
    x = logits(shape, dtype, device)
    temp, top_k, top_p = asks(ask, shape[0], device)
    row = dict(shape=name, dims=list(shape), dtype=str(dtype).removeprefix("torch."), ask=ask)
    new = lambda: triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)   # noqa: E731
    row["new_ms"] = time_ms(new, opts.iters, device)
    if opts.baseline:
        row["old_ms"] = time_ms(lambda: old_triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw),
                                opts.iters, device)
    if opts.check:
        exact, worst = compare(torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw), new())
        row.update(exact=exact, max_rel_diff=worst)
    return row


def sweep(table, device, opts) -> list[dict]:
    rows, saved = [], (F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK, F.NUM_WARPS, F.HISTOGRAM)
    try:
        for setting in SWEEP:
            F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK, F.NUM_WARPS, F.HISTOGRAM = setting
            for name, ask in SWEEP_CASES if table is SHAPES else [(name, "mixed") for name in table]:
                shape, dtype, kw = table[name]
                x = logits(shape, dtype, device)
                temp, top_k, top_p = asks(ask, shape[0], device)
                ms = time_ms(lambda: triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw), opts.iters, device)
                row = dict(split=setting[0], count_block=setting[1], mass_block=setting[2], num_warps=setting[3],
                           histogram=setting[4], shape=name, ask=ask, new_ms=ms)
                if opts.check:
                    ref = torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw)
                    row["exact"] = compare(ref, triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), **kw))[0]
                rows.append(row)
                shown = (f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                print("sweep " + "  ".join(shown), flush=True)
    finally:
        F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK, F.NUM_WARPS, F.HISTOGRAM = saved
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", help=f"of {list(SHAPES)} (default: all; with --tiny, of {list(TINY)})")
    p.add_argument("--asks", nargs="+", default=list(ASKS), choices=ASKS)
    p.add_argument("--iters", type=int, default=5, help="timed runs a case (the median is reported)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the replaced kernel")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check against torch")
    p.add_argument("--sweep", action="store_true", help="also time the new kernel's SWEEP settings")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU: under TRITON_INTERPRET=1 only)")
    p.add_argument("--json", type=Path, help="where the JSON goes (default: $OUT/filters_bench.json if $OUT)")
    opts = p.parse_args(argv)
    table = TINY if opts.tiny else SHAPES
    unknown = sorted(set(opts.shapes or []) - set(table))
    if unknown:
        p.error(f"unknown shapes {unknown}: one of {list(table)}")
    if opts.iters < 1:
        p.error("--iters must be at least 1")
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
    rows = []
    print(f"{'shape':<14}{'dtype':<10}{'ask':<9}{'new ms':>9}{'old ms':>9}{'speedup':>9}  exact  max rel diff",
          flush=True)
    for name in opts.shapes or list(table):
        shape, dtype, kw = table[name]
        for ask in opts.asks:
            row = run_case(name, ask, shape, dtype, kw, device, opts)
            rows.append(row)
            old = row.get("old_ms")
            print(f"{name:<14}{row['dtype']:<10}{ask:<9}{row['new_ms']:>9.3f}"
                  f"{old if old is not None else float('nan'):>9.3f}"
                  f"{old / row['new_ms'] if old is not None else float('nan'):>9.1f}"
                  f"  {str(row.get('exact', '-')):<5}  {row.get('max_rel_diff', float('nan')):.2e}", flush=True)
    report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__,
                  settings=dict(split=F.SPLIT, count_block=F.COUNT_BLOCK, mass_block=F.MASS_BLOCK,
                                num_warps=F.NUM_WARPS, histogram=F.HISTOGRAM), cases=rows)
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
    failed = [r for r in rows + report.get("sweep", []) if r.get("exact") is False]
    if failed or report.get("graph_replay_equal") is False:
        graph = "; graph replay differs" if report.get("graph_replay_equal") is False else ""
        print(f"NOT EXACT: {len(failed)} case(s){graph}")
        return 1
    return 0


# ---- the baseline: model/kernels/filters.py before the histogram passes, verbatim but renamed --------

OLD_BLOCK = 256
OLD_SPLIT = 16384


@triton.jit
def _old_logit_keys(x, BITS: tl.constexpr):
    """Order-preserving int64 keys of fp32 x in the logits' own BITS-bit precision (bf16 values in fp32
    are their 16 bits shifted up), -0 as +0."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) >> (32 - BITS)
    return tl.where(ordered == -1, 0, ordered)


@triton.jit
def _old_key_logit(key, BITS: tl.constexpr):
    """The fp32 logit of a key of _old_logit_keys."""
    ordered = (key << (32 - BITS)).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _old_chosen(totals_ptr, n, splits, target, NC: tl.constexpr, SPLITS_P2: tl.constexpr):
    """The digit a pass's totals decide for row position n: the largest candidate whose total (over the
    splits) reaches the target, 0 if none; and whether candidate 0 (everything above the prefix) did."""
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, NC)
    parts = tl.load(totals_ptr + (n * splits + s[:, None]) * NC + d[None, :], mask=s[:, None] < splits, other=0.0)
    ok = tl.sum(parts, 0) >= target
    return tl.maximum(tl.sum(ok.to(tl.int32), 0) - 1, 0), tl.sum(tl.where(d == 0, ok.to(tl.int32), 0), 0) > 0


@triton.jit
def _old_pass_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, prev_ptr, prefix_ptr, out_ptr, xk_ptr, norm_ptr,
                        P, V, splits, norm_splits, softcap,
                        MODE: tl.constexpr, PASS: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr,
                        ON_SCALED: tl.constexpr, INTERPRETED: tl.constexpr, NC: tl.constexpr,
                        SPLITS_P2: tl.constexpr, NORM_SPLITS_P2: tl.constexpr, SPLIT_SIZE: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr):
    """COUNT pass PASS: out[n, split, d] = entries with key >= prefix + d << shift; LOG_NORM: out[n, split,
    0:2] = (max, sum exp(v - max)) of the top-k survivors' values (and xk[n] = the top-k threshold's
    logit); MASS pass PASS: out[n, split, d] = their probability mass at keys >= prefix + d << shift.
    prev: the previous pass's totals (PASS > 0); prefix[PASS - 1] the prefix they were counted at."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    row = n // P
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    active = (k > 0) if MODE == COUNT else (p < 1)
    d = tl.arange(0, NC)
    # per-lane totals, summed across lanes once after the loop (a cross-lane sum every tile cost more)
    acc = tl.zeros((BLOCK_SIZE, NC), dtype=tl.float32)
    m = tl.full((), -float("inf"), tl.float32)
    z = tl.zeros((), tl.float32)
    if active:
        temp = tl.load(temp_ptr + row)
        t_eff = tl.where(temp > 0, temp, 1.0)
        if MODE == COUNT:
            target = k.to(tl.float32)
        else:
            target = p
        prefix = tl.full((), -(1 << (BITS - 1)), tl.int64)
        if PASS > 0:
            digit, _ = _old_chosen(prev_ptr, n, splits, target, NC, SPLITS_P2)
            prefix = tl.load(prefix_ptr + (PASS - 1) * tl.num_programs(0) + n) + (digit.to(tl.int64) << (SHIFT + 4))
        if split == 0:
            tl.store(prefix_ptr + PASS * tl.num_programs(0) + n, prefix)
        candidates = prefix + (d.to(tl.int64) << SHIFT)
        if MODE != COUNT:
            thr = decided_value(tl.load(xk_ptr + n), t_eff, softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
        if MODE == MASS:
            s = tl.arange(0, NORM_SPLITS_P2)
            inside_s = s < norm_splits
            ms = tl.load(norm_ptr + (n * norm_splits + s) * NC, mask=inside_s, other=-float("inf"))
            zs = tl.load(norm_ptr + (n * norm_splits + s) * NC + 1, mask=inside_s, other=0.0)
            top = tl.max(ms, 0)
            safe = tl.where(top == -float("inf"), 0.0, top)
            norm = safe + tl.log(tl.sum(tl.where(zs > 0, zs * tl.exp(ms - safe), 0.0), 0))
        row_ptr = x_ptr + n.to(tl.int64) * V
        start = split * SPLIT_SIZE
        for off in range(0, SPLIT_SIZE, BLOCK_SIZE):
            cols = start + off + tl.arange(0, BLOCK_SIZE)
            inside = cols < V
            x = tl.load(row_ptr + cols, mask=inside, other=-float("inf")).to(tl.float32)
            if MODE == COUNT:
                at = (_old_logit_keys(x, BITS)[:, None] >= candidates[None, :]) & inside[:, None]
                acc += at.to(tl.float32)
            else:
                v = decided_value(x, t_eff, softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
                v = tl.where(inside & (v >= thr), v, -float("inf"))
                if MODE == LOG_NORM:
                    new_m = tl.maximum(m, tl.max(v, 0))
                    safe_m = tl.where(new_m == -float("inf"), 0.0, new_m)
                    z = z * tl.exp(m - safe_m) + tl.sum(tl.exp(v - safe_m), 0)
                    m = new_m
                else:
                    mass = tl.exp(v - norm)
                    at = _old_logit_keys(x, BITS)[:, None] >= candidates[None, :]
                    acc += tl.where(at, mass[:, None], 0.0)
    out = (n * splits + split) * NC
    if MODE == LOG_NORM:
        tl.store(out_ptr + out + d, tl.where(d == 0, m, tl.where(d == 1, z, 0.0)))
    else:
        tl.store(out_ptr + out + d, tl.sum(acc, 0))


@triton.jit
def _old_top_k_logit_kernel(top_k_ptr, totals_ptr, first_ptr, prefix_ptr, xk_ptr, P, splits, last,
                        BITS: tl.constexpr, NC: tl.constexpr, SPLITS_P2: tl.constexpr):
    """xk[n]: the k-th largest logit of row position n (-inf where the row asks no top-k, or more than the
    vocabulary), from the last count pass."""
    n = tl.program_id(0)
    k = tl.load(top_k_ptr + n // P)
    digit, _ = _old_chosen(totals_ptr, n, splits, k.to(tl.float32), NC, SPLITS_P2)
    _, reached = _old_chosen(first_ptr, n, splits, k.to(tl.float32), NC, SPLITS_P2)   # k entries at all
    key = tl.load(prefix_ptr + last * tl.num_programs(0) + n) + digit.to(tl.int64)
    tl.store(xk_ptr + n, tl.where((k > 0) & reached, _old_key_logit(key, BITS), -float("inf")))


@triton.jit
def _old_finish_kernel(temp_ptr, top_p_ptr, xk_ptr, totals_ptr, first_ptr, prefix_ptr, out_ptr, P, splits, last,
                   softcap, BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ON_SCALED: tl.constexpr,
                   INTERPRETED: tl.constexpr, NC: tl.constexpr, SPLITS_P2: tl.constexpr):
    """out[n]: the threshold v(max(top-k logit, top-p logit)), -inf for a row asking neither filter."""
    n = tl.program_id(0)
    row = n // P
    p = tl.load(top_p_ptr + row)
    temp = tl.load(temp_ptr + row)
    t_eff = tl.where(temp > 0, temp, 1.0)
    raw = tl.load(xk_ptr + n)
    if p < 1:
        digit, _ = _old_chosen(totals_ptr, n, splits, p, NC, SPLITS_P2)
        _, reached = _old_chosen(first_ptr, n, splits, p, NC, SPLITS_P2)   # the whole mass reaches p
        key = tl.load(prefix_ptr + last * tl.num_programs(0) + n) + digit.to(tl.int64)
        raw = tl.where(reached, tl.maximum(raw, _old_key_logit(key, BITS)), raw)
    v = decided_value(raw, t_eff, softcap, HAS_SOFTCAP, ON_SCALED, INTERPRETED)
    tl.store(out_ptr + n, tl.where(raw == -float("inf"), -float("inf"), v))


def old_triton_threshold(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     vocab_start: int, tp: TPGroup, *, softcap: float | None = None,
                     on_scaled: bool = True) -> torch.Tensor:
    """model.sampling.filters.torch_threshold's contract on CUDA (and the interpreter)."""
    R, P, V = x.shape
    RP, dev = R * P, x.device
    x = x.contiguous()
    bits = 16 if x.dtype == torch.bfloat16 else 32
    passes = bits // 4
    splits = triton.cdiv(V, OLD_SPLIT)
    temp = temperature.float().contiguous()
    top_k, top_p = top_k.contiguous(), top_p.float().contiguous()
    flags = dict(BITS=bits, HAS_SOFTCAP=softcap is not None, ON_SCALED=on_scaled, INTERPRETED=INTERPRETED,
                 NC=CANDIDATES, SPLITS_P2=triton.next_power_of_2(splits))
    cap = float(softcap or 1.0)
    counts = torch.empty(passes, RP, splits, CANDIDATES, device=dev)
    masses = torch.empty_like(counts)
    norm = torch.empty(RP, splits, CANDIDATES, device=dev)
    prefix_k = torch.empty(passes, RP, dtype=torch.int64, device=dev)
    prefix_p = torch.empty_like(prefix_k)
    xk = torch.empty(RP, device=dev)

    def run(mode, i, prev, prefix, out, norm_in, norm_splits):
        _old_pass_kernel[(RP, splits)](
            x, temp, top_k, top_p, prev, prefix, out, xk, norm_in, P, V, splits, norm_splits, cap, MODE=mode.value,
            PASS=i, SHIFT=bits - 4 * (i + 1), NORM_SPLITS_P2=triton.next_power_of_2(norm_splits),
            SPLIT_SIZE=min(OLD_SPLIT, V),
            BLOCK_SIZE=min(OLD_BLOCK, triton.next_power_of_2(V)), num_warps=4, **flags)
        tp.all_reduce(out)   # a count or a mass: the totals over ranks (the log-normaliser is combined below)

    for i in range(passes):
        run(COUNT, i, counts[i - 1] if i else counts[0], prefix_k, counts[i], norm, 1)
    _old_top_k_logit_kernel[(RP,)](top_k, counts[-1], counts[0], prefix_k, xk, P, splits, passes - 1, BITS=bits,
                               NC=CANDIDATES, SPLITS_P2=triton.next_power_of_2(splits))
    _old_pass_kernel[(RP, splits)](
        x, temp, top_k, top_p, counts[0], prefix_p, norm, xk, norm, P, V, splits, 1, cap, MODE=LOG_NORM.value, PASS=0,
        SHIFT=bits - 4, NORM_SPLITS_P2=1, SPLIT_SIZE=min(OLD_SPLIT, V),
        BLOCK_SIZE=min(OLD_BLOCK, triton.next_power_of_2(V)), num_warps=4,
        **flags)
    norm_in, norm_splits = norm, splits
    if tp.is_parallel:   # (max, sum) pairs combine by rescaling, not by a plain sum: over the ranks here
        m = tp.all_reduce(norm[..., 0].amax(1), torch.distributed.ReduceOp.MAX)
        safe = torch.where(torch.isfinite(m), m, 0.0)
        z = tp.all_reduce((norm[..., 1] * torch.exp(norm[..., 0] - safe[:, None])).nan_to_num(0.0).sum(1))
        norm_in, norm_splits = torch.stack([m, z], -1).reshape(RP, 1, 2), 1
        norm_in = torch.nn.functional.pad(norm_in, (0, CANDIDATES - 2))
    for i in range(passes):
        run(MASS, i, masses[i - 1] if i else masses[0], prefix_p, masses[i], norm_in, norm_splits)
    out = torch.empty(RP, dtype=torch.float32, device=dev)
    _old_finish_kernel[(RP,)](temp, top_p, xk, masses[-1], masses[0], prefix_p, out, P, splits, passes - 1, cap,
                          **flags)
    return out.view(R, P)


if __name__ == "__main__":
    sys.exit(main())
