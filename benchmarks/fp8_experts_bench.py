"""DiffusionGemma 26B-A4B's FP8 experts on the GPU host: our triton grouped kernel (as GemmaExperts runs
it, FP8 operands) at a sweep of tiles over the dense weight (SWEEP) and the weight chunked for its tiles
(CHUNKED_SWEEP, the served layout), and CUTLASS's grouped FP8 GEMM (torch._scaled_grouped_mm), per
projection at 1-16 canvases with the served routing, against the FP8 weight-read floor at --bandwidth.
Each call is the mean of 50 replays in one CUDA graph; each tile's output is compared with the served
tiles' (anything above a few 1e-3 is a bug, not rounding).

    PYTHONPATH=. python3 benchmarks/fp8_experts_bench.py [--json FILE]
"""
from __future__ import annotations

import argparse
import sys
from ast import literal_eval
from pathlib import Path

import torch

from benchmarks.fp8_gemm_bench import require_fp8_gpu, save, try_us

E, HIDDEN, INTERMEDIATE, TOP_K = 128, 2816, 704, 8
TOKENS = (256, 1024, 2048, 4096)
# (rows, columns, K a step, warps, stages[, swap]) over the dense weight; the first is the previous served tiles
SWEEP = ((64, 128, 128, 4, 4), (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4),
         (64, 256, 128, 8, 3), (64, 128, 256, 8, 2), (64, 128, 256, 8, 3), (64, 64, 256, 4, 3),
         (64, 256, 64, 8, 4), (64, 128, 64, 4, 5), (128, 128, 128, 8, 3),
         # around the served tiles: deeper pipelines, one warpgroup (the H200 wants more bytes in flight)
         (64, 128, 128, 4, 5), (64, 128, 128, 4, 6), (64, 64, 128, 4, 6), (64, 128, 64, 4, 6),
         (64, 128, 256, 4, 3), (64, 128, 128, 4, 4, True),
         # swapped (y^T = W x^T): the tokens as the MMA's narrow side, 16 or 32 rows a tile
         (16, 128, 128, 4, 4, True), (16, 64, 128, 4, 4, True), (16, 128, 256, 4, 3, True),
         (16, 256, 128, 8, 4, True), (32, 128, 128, 4, 4, True), (32, 64, 256, 4, 3, True),
         (16, 64, 256, 4, 4, True), (64, 128, 128, 8, 3, True))
# timed with the weight chunked for the tiles (model.kernels.invariant.ChunkedWeight), keyed "... chunked"; the
# first is what the served experts run (FP8_GROUPED_TILES, over the weights chunked at load)
CHUNKED_SWEEP = ((64, 128, 64, 4, 6), (64, 128, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 128, 4, 6),
                 (64, 128, 64, 4, 8), (64, 128, 64, 4, 4),
                 (64, 256, 128, 8, 3), (64, 128, 256, 4, 3), (16, 128, 128, 4, 4, True), (32, 64, 256, 4, 3, True))


SERVED = f"{CHUNKED_SWEEP[0]} chunked"


def problems(tokens: int, device: str = "cuda"):
    """(name, xq, sx, rows or None, wq [E, N, K], sw [E, N], ends, floor bytes) of both projections."""
    from model.fp8 import quantize_per_channel, quantize_per_token
    from model.kernels.routing import route, sort_pairs

    gen = torch.Generator(device=device).manual_seed(tokens)
    scores = torch.randn(tokens, E, device=device, generator=gen)
    _, ids = route(scores, torch.ones(E, device=device), TOP_K)
    token, _, ends, *_ = sort_pairs(ids, E, 64)
    for name, n, k, rows in (("gate_up", 2 * INTERMEDIATE, HIDDEN, token), ("down", HIDDEN, INTERMEDIATE, None)):
        x = torch.randn(tokens if rows is not None else tokens * TOP_K, k, device=device, generator=gen).bfloat16()
        xq, sx = quantize_per_token(x)
        wq, sw = quantize_per_channel(torch.randn(E, n, k, device=device, generator=gen) * 0.02)
        yield name, xq, sx[:, 0].float(), rows, wq, sw[..., 0].float(), ends, E * n * k


def measure(bandwidth: float) -> dict:
    from model.kernels.fp8 import grouped_in_cutlass
    from model.kernels.invariant import Tiles, chunk_weight, grouped_matmul, make_tile_map

    result = {}
    for tokens in TOKENS:
        for name, xq, sx, rows, wq, sw, ends, floor_bytes in problems(tokens):
            p = tokens * TOP_K
            row = {"floor_us": floor_bytes / bandwidth * 1e6}
            ref = None
            for shape, chunked in [(s, False) for s in SWEEP] + [(s, True) for s in CHUNKED_SWEEP]:
                tiles, key = Tiles(*shape), str(shape) + (" chunked" if chunked else "")
                tile_map = make_tile_map(ends, -(-p // tiles.m) + E, tiles.m)
                w = chunk_weight(wq, tiles.n, tiles.k) if chunked else wq
                fn = lambda: grouped_matmul(xq, w, ends, rows, tile_map, tiles, sx, sw, torch.bfloat16)  # noqa: E731
                us = try_us(fn)
                if isinstance(us, str):
                    row[key] = us
                    continue
                out = fn().float()
                ref = out if ref is None else ref
                row[key] = {"us": us, "over_floor": us / row["floor_us"],
                            "max_rel_diff": ((out - ref).abs().max() / ref.abs().max()).item()}
                del w
            row["cutlass_us"] = try_us(lambda: grouped_in_cutlass(xq, sx, wq, sw, ends, rows, torch.bfloat16))
            result[f"{name}_t{tokens}"] = row
            timed = {k: v["us"] for k, v in row.items() if isinstance(v, dict)}
            best = min(timed, key=timed.get) if timed else None
            print(f"{name:<8}{tokens:>5}  floor {row['floor_us']:.1f} us  served {timed.get(SERVED)}  "
                  f"best {best} {timed.get(best)}  cutlass {row['cutlass_us']}", flush=True)
    for tokens in TOKENS:   # the routing's one tile map serves both projections: one height for the pair
        pair = best_pair(result, tokens)
        print(f"best pair at {tokens} tokens: gate_up {pair[0]}, down {pair[1]}, {pair[2]:.1f} us a layer", flush=True)
    return result


def best_pair(result: dict, tokens: int) -> tuple[str, str, float]:
    """(gate_up tiles, down tiles, their summed us) with the least sum among tiles of one height."""
    gate_up, down = result[f"gate_up_t{tokens}"], result[f"down_t{tokens}"]
    timed = lambda row: {k: v["us"] for k, v in row.items() if isinstance(v, dict)}  # noqa: E731
    g, d = timed(gate_up), timed(down)
    height = lambda key: literal_eval(key.removesuffix(" chunked"))[0]  # noqa: E731
    return min(((a, b, g[a] + d[b]) for a in g for b in d if height(a) == height(b)),
               key=lambda t: t[2])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the floor assumes")
    parser.add_argument("--json", type=Path, help="where the JSON goes (default: $OUT/fp8_experts_bench.json if $OUT)")
    opts = parser.parse_args(argv)
    require_fp8_gpu("fp8_experts_bench")
    save(measure(opts.bandwidth), opts.json, "fp8_experts_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
