"""DiffusionGemma 26B-A4B's attention at one canvas, on the GPU host: the served call
(model.kernels.attention.attention: its key splits and their combine) per layer kind (LAYERS), the call
at each of SWEEP's tiles, the split combine alone at its served tiles against the attention program's
(`same_bits`), and the libraries' attention kernels on the same problem (`libraries_us`: SDPA's
FlashAttention-2, cuDNN and memory-efficient backends, flex_attention), each compared with the served
output. Each call is the mean of 200 replays in one CUDA graph; `step_us` weighs the layer kinds as a
step runs them. docs/benchmarking.md says more.

    PYTHONPATH=. python3 benchmarks/attention_bench.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

C, WINDOW, HEADS = 256, 1024, 16
# layer kind -> (head dim, kv heads, keys the row's cache holds (before its canvas), window or None, layers)
LAYERS = {"sliding": (256, 8, 1280, WINDOW, 25), "full_1280": (512, 2, 1280, None, 5),
          "full_2048": (512, 2, 2048, None, 5)}
# (query rows, keys, warps, stages) a program, by head dim, timed beside the served lone-canvas tiles
# (model.kernels.attention.TILES, chosen before the key loop was pipelined): more stages, or fewer keys a
# tile to make room for a second stage at 512
# (each fits the H200's shared memory compiled for sm_90; (128, 64, 8, 3) and (64, 32, 8, 3) do not)
SWEEP = {256: ((128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 64, 8, 3)),
         512: ((64, 64, 8, 1), (64, 32, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2), (32, 32, 4, 3))}


def problem(d: int, hkv: int, keys: int, device: str = "cuda"):
    """q [1, C, 16, d] and a one-slot cache of its `keys` positions before the canvas and the canvas's:
    the arguments of attention() for one bidirectional canvas row."""
    q = torch.randn(1, C, HEADS, d, device=device).bfloat16()
    k = torch.randn(1, keys + C, hkv, d, device=device).bfloat16()
    v = torch.randn(1, keys + C, hkv, d, device=device).bfloat16()
    meta = [torch.tensor([0], device=device), torch.tensor([keys], device=device), torch.tensor([C], device=device),
            torch.tensor([0], device=device)]   # slot, start, length, causal
    return q, k, v, meta


def visible(keys: int, window: int | None) -> slice:
    """The positions a bidirectional canvas row at `keys` sees: all, or under a window its last W - 1
    prefix positions and the canvas."""
    return slice(0 if window is None else max(keys - window + 1, 0), keys + C)


def library_problem(q, k, v, keys: int, window: int | None):
    """The problem() of one bidirectional canvas row as SDPA takes it: q [1, Hq, C, d], k and v
    [1, Hkv, visible, d] (the positions the row sees)."""
    seen = visible(keys, window)
    return (q.transpose(1, 2).contiguous(), k[:, seen].transpose(1, 2).contiguous(),
            v[:, seen].transpose(1, 2).contiguous())


def library_calls(q, k, v, flex: bool = True) -> dict:
    """name -> a call of a library's attention on library_problem()'s tensors (scale 1, no mask);
    `flex`: flex_attention too (compiled: slow to build on a CPU)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    repeat = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)

    def sdpa(backend, gqa: bool):
        def call():
            with sdpa_kernel(backend):
                if gqa:
                    return F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=True)
                return F.scaled_dot_product_attention(q, kr, vr, scale=1.0)
        return call

    calls = {f"{name}{'' if gqa else '_repeated'}": sdpa(backend, gqa)
             for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                   ("efficient", SDPBackend.EFFICIENT_ATTENTION)) for gqa in (True, False)}
    if flex:
        compiled = torch.compile(flex_attention, dynamic=False)
        calls["flex"] = lambda: compiled(q, k, v, scale=1.0, enable_gqa=True)
    return calls


def libraries(served_out, q, k, v, keys: int, window: int | None, timed: bool = True, flex: bool = True) -> dict:
    """Each library call's time (us; `timed`) and its difference from the served output, or why it
    cannot run."""
    from benchmarks.fp8_gemm_bench import time_us

    lq, lk, lv = library_problem(q, k, v, keys, window)
    ref = served_out.float()
    row = {}
    for name, call in library_calls(lq, lk, lv, flex).items():
        try:
            out = call().transpose(1, 2).float()
            row[f"{name}_rel_diff"] = ((out - ref).abs().max() / ref.abs().max()).item()
            if timed:
                row[f"{name}_us"] = time_us(call)
        except Exception as err:   # a backend that does not take the shape (head dim 512) says why
            row[name] = repr(err)[:160]
    return row


def combine_problem(d: int, hkv: int, splits: int, device: str = "cuda"):
    """Random partial states of `splits` key splits for one canvas row (maxima, positive sums)."""
    lg = C * (HEADS // hkv)
    part = torch.randn(splits, hkv, lg, d, device=device)
    ml = torch.stack([torch.randn(splits, hkv, lg, device=device) * 4,
                      torch.rand(splits, hkv, lg, device=device) * 100 + 1], dim=-1)
    return part, ml


def measure() -> dict:
    from benchmarks.fp8_gemm_bench import time_us, try_us
    from model.kernels import attention as A

    result, step = {}, {"served": 0.0, "combine_served": 0.0, "combine_before": 0.0}
    for name, (d, hkv, keys, window, layers) in LAYERS.items():
        q, k, v, meta = problem(d, hkv, keys)
        bm, _, warps, _, splits = A._config(d, C * HEADS // hkv, 1, hkv, keys + C, q.device, False)

        def call(**how):
            return A.attention(q, k, v, *meta, 1.0, window, keys=keys + C, **how)  # noqa: B023

        served = time_us(call)
        weight = layers / (1 if window is not None else 2)   # full layers: half at each length
        row = {"served_us": served, "splits": splits, "attention_rows": bm, "attention_warps": warps}
        if splits > 1:
            part, ml = combine_problem(d, hkv, splits)
            tiles = {"served": (A.combine_rows(d), 4), "before": (bm, warps)}
            outs = {}
            for tile, (rows, w) in tiles.items():
                out = torch.empty(1, C, HEADS, d, device="cuda", dtype=torch.bfloat16)
                row[f"combine_{tile}_us"] = time_us(lambda: A.split_combine(part, ml, out, rows, w))  # noqa: B023
                row[f"combine_{tile}_tile"] = (rows, w)
                outs[tile] = out
            row["same_bits"] = torch.equal(outs["served"], outs["before"])
            step["combine_served"] += weight * row["combine_served_us"]
            step["combine_before"] += weight * row["combine_before_us"]
        step["served"] += weight * served
        row["tiles_us"] = {str(t): try_us(lambda: call(tiles=t)) for t in SWEEP[d]}  # noqa: B023
        row["libraries_us"] = libraries(call(), q, k, v, keys, window)
        result[name] = row
        print(name, json.dumps(row), flush=True)
    result["step_us"] = step
    print("a step's 30 layers (full ones half at each length), us:", json.dumps(step), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    result = measure()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
