"""Dense FP8 GEMMs at few rows, on the GPU host: cuBLAS's FP8 GEMM (torch._scaled_mm), what the served
FP8 dense layers run (model.kernels.fp8.scaled_linear: cuBLAS's, or the split-K kernel where it wins), the
batch-invariant split-K matmul with FP8 operands, and cuBLAS's BF16 GEMM, at one family's projection
shapes, against the FP8 weight-read floor at --bandwidth; `--sweep` also times the triton FP8 matmul's
tiles and K-splits. Each call is the mean of 200 replays in one CUDA graph; the two FP8 kernels are
compared (they sum in different orders: a few 1e-3 is expected, a wrong scale is ~1).

    PYTHONPATH=. python3 benchmarks/fp8_gemm_bench.py [--family diffusion-gemma] [--sweep] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

# family -> ({projection: (N, K)}, rows): the 8B's; DiffusionGemma's sliding (qkv 16 + 2 x 8 heads of 256)
# and full (16 heads of 512 + one K = V head pair) attention layers and its dense MLP (intermediate 2112)
SHAPES = {"nemotron-ld": ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
                          (32, 128, 512)),
          "diffusion-gemma": ({"qkv": (8192, 2816), "o": (2816, 4096), "qkv_full": (9216, 2816),
                               "o_full": (2816, 8192), "gate_up": (4224, 2816), "down": (2816, 2112)}, (256, 1024))}

# the triton FP8 matmul's sweep: (rows, columns, K a step, warps, stages) x K-splits
SWEEP_TILES = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 3),
               (64, 128, 256, 4, 3))
SWEEP_SPLITS = (1, 2, 4)


def time_us(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()   # untimed, in case a graph's first replay pays for its upload (a guess at why an
    # experts sweep's first setting timed 4-11% slow where the step showed no difference)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def try_us(fn) -> float | str:
    """time_us (50 replays) of a sweep's setting, or why it could not run (a tile that does not fit is a
    row of the sweep, not its end)."""
    try:
        return time_us(fn, 50)
    except Exception as err:
        return repr(err)[:120]


def measure(bandwidth: float, family: str = "nemotron-ld", sweep: bool = False) -> dict:
    from model.fp8 import quantize_per_channel, quantize_per_token
    from model.kernels.fp8 import scaled_linear
    from model.kernels.invariant import Tiles, matmul

    result = {}
    shapes, rows = SHAPES[family]
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, sw = quantize_per_channel(w)
        sw, wb = sw.float(), w.bfloat16()
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, sx = quantize_per_token(x)
            sx = sx[:, 0]
            cublas = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx.view(-1, 1), scale_b=sw.view(1, -1),  # noqa: E731
                                              out_dtype=torch.bfloat16)
            row = {"cublas_fp8_us": time_us(cublas),
                   "served_fp8_us": time_us(lambda: scaled_linear(xq, sx, wq, sw, torch.bfloat16)),
                   "invariant_fp8_us": time_us(lambda: scaled_linear(xq, sx, wq, sw, torch.bfloat16, invariant=True)),
                   "cublas_bf16_us": time_us(lambda: x @ wb.t()),
                   "fp8_floor_us": n * k / bandwidth * 1e6}
            a = cublas().float()
            b = scaled_linear(xq, sx, wq, sw, torch.bfloat16, invariant=True).float()
            row["max_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
            if sweep:
                row["triton_sweep_us"] = {f"{tiles} x{splits}": try_us(lambda: matmul(
                    xq, wq, Tiles(*tiles), sx, sw.view(-1), torch.bfloat16, splits)) for tiles in SWEEP_TILES
                    for splits in SWEEP_SPLITS}
                timed = {k: v for k, v in row["triton_sweep_us"].items() if isinstance(v, float)}
                row["triton_best"] = min(timed, key=timed.get) if timed else None
            result[f"{name}_m{m}"] = row
            print(f"{name:<8}{m:>5}  " + "  ".join(f"{key}={value:.4g}" for key, value in row.items()
                                                   if isinstance(value, float)), flush=True)
            if sweep:
                print(f"{'':13}triton best {row['triton_best']}: {row['triton_sweep_us'].get(row['triton_best'])}",
                      flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=list(SHAPES), default="nemotron-ld")
    parser.add_argument("--sweep", action="store_true", help="also the triton FP8 matmul's tiles and K-splits")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the floor assumes")
    parser.add_argument("--json", type=Path, help="where the JSON goes (default: $OUT/fp8_gemm_bench.json if $OUT)")
    opts = parser.parse_args(argv)
    require_fp8_gpu("fp8_gemm_bench")
    save(measure(opts.bandwidth, opts.family, opts.sweep), opts.json, "fp8_gemm_bench")
    return 0


def require_fp8_gpu(bench: str) -> None:
    """Exits saying why where there is no GPU with FP8 tensor cores (the FP8 benchmarks' only host)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit(f"{bench} needs a GPU with FP8 tensor cores (compute capability 8.9+)")


def save(result: dict, path: Path | None, bench: str) -> None:
    """The result as JSON at `path`, else at $OUT/<bench>.json where $OUT is set (the device tool's)."""
    out = path or (Path(os.environ["OUT"]) / f"{bench}.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
