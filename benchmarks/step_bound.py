"""The least time a step can take at a batch size, from its work alone, without a GPU: each part of a
forward (experts, dense, head, attention) takes at least its bytes over the memory bandwidth or its FLOPs
over the tensor cores' rate, the parts one after another, the model built from the full-size shapes as
fake tensors. A step of c canvases against one, c x t(1) / t(c), is the most a server's throughput at
concurrency c can gain over 1. docs/benchmarking.md has each part's bytes and FLOPs.

    python -m benchmarks.step_bound [--tflops 750] [--tbps 4.3] [--keys 2048] [--results-dir DIR]
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path


H200_TFLOPS = 750.0   # dense bf16 tensor-core rate the brief gives for the H200 (FP8: twice)
H200_TBPS = 4.3       # its copy bandwidth, as benchmarks/roofline.py measures it


@dataclass(frozen=True)
class Shape:
    """What the bound reads of a model: its parameter counts by part and its attention."""
    name: str
    canvas: int                # tokens a row computes a step
    vocab: int
    hidden: int
    experts: int               # expert parameters (all experts), 0 without
    num_experts: int
    top_k: int
    dense: int                 # other linear parameters
    head_reads: int            # reads of the V x H matrix a step (head; + self-conditioning's P W)
    # per layer: (q heads, kv heads, head_dim, window, whether its values are its keys)
    layers: tuple[tuple[int, int, int, int | None, bool], ...]


def shape_of(family: str) -> Shape:
    """The full-size shape of `family` (benchmarks/shapes.py), counted from its model built as fake tensors."""
    from benchmarks.shapes import fake_model

    cfg, net = fake_model(family)
    params = [tuple(p.shape) for p in net.parameters() if p.dim() >= 2]
    v, h = cfg.vocab_size, cfg.hidden_size
    uniform = family == "diffusion-gemma"
    if uniform:
        layers = tuple((cfg.num_attention_heads, cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i),
                        cfg.sliding_window if kind == "sliding_attention" else None,
                        kind == "full_attention" and cfg.attention_k_eq_v)
                       for i, kind in enumerate(cfg.layer_type_list))
    else:
        layers = ((cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size, None, False),) \
            * cfg.num_hidden_layers
    return Shape(name=family, canvas=cfg.canvas_length, vocab=v, hidden=h,
                 experts=sum(math.prod(s) for s in params if len(s) == 3),
                 num_experts=getattr(cfg, "num_experts", 0) or 0, top_k=getattr(cfg, "top_k_experts", 0) or 0,
                 dense=sum(math.prod(s) for s in params if len(s) == 2 and v not in s),
                 head_reads=2 if uniform else 1, layers=layers)


def bound(shape: Shape, rows: int, keys: int, fp8: bool = False, tflops: float = H200_TFLOPS,
          tbps: float = H200_TBPS) -> dict[str, float]:
    """Seconds per part, and their sum, of a step of `rows` rows each reading `keys` keys."""
    t = rows * shape.canvas
    weight_bytes, rate = (1, 2 * tflops * 1e12) if fp8 else (2, tflops * 1e12)
    bw = tbps * 1e12
    parts = {}
    if shape.experts:
        reached = 1 - (1 - shape.top_k / shape.num_experts) ** t   # share of experts some token routes to
        parts["experts"] = max(shape.experts * reached * weight_bytes / bw,
                               2 * shape.experts * shape.top_k / shape.num_experts * t / rate)
    parts["dense"] = max(shape.dense * weight_bytes / bw, 2 * shape.dense * t / rate)
    vh = shape.vocab * shape.hidden
    parts["head"] = shape.head_reads * max(vh * 2 / bw, 2 * vh * t / (tflops * 1e12))   # BF16 in either
    flops = kv = 0
    for hq, hkv, d, window, k_is_v in shape.layers:
        seen = min(keys, window + shape.canvas) if window else keys
        flops += 4 * t * seen * hq * d
        kv += rows * seen * (1 if k_is_v else 2) * hkv * d * 2
    parts["attention"] = max(kv / bw, flops / (tflops * 1e12))
    parts["step"] = sum(parts.values())
    return parts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tflops", type=float, default=H200_TFLOPS, help="dense bf16 TFLOP/s (FP8: twice)")
    ap.add_argument("--tbps", type=float, default=H200_TBPS, help="memory bandwidth, TB/s")
    ap.add_argument("--keys", type=int, default=2048, help="keys a row reads (prompt + what it has generated)")
    ap.add_argument("--results-dir", type=Path, help="also write the bounds as a result file there "
                                                     "(benchmarks/results.py; e.g. benchmarks/results)")
    args = ap.parse_args(argv)
    figures = {}
    for family, batches, model, x in (("nemotron-ld", (1, 4, 8, 16), "nemotron-ld-8b", "b"),
                                      ("diffusion-gemma", (1, 2, 4, 8), "diffusion-gemma-26b-a4b", "c")):
        shape = shape_of(family)
        for fp8 in (False, True):
            one = bound(shape, 1, args.keys, fp8, args.tflops, args.tbps)["step"]
            print(f"{family} {'FP8' if fp8 else 'BF16'}, {args.keys} keys, {args.tflops:.0f} TFLOP/s, "
                  f"{args.tbps} TB/s:")
            for b in batches:
                p = bound(shape, b, args.keys, fp8, args.tflops, args.tbps)
                split = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in p.items() if k != "step")
                print(f"  {b:2d} rows: step >= {p['step'] * 1e3:6.2f} ms ({split}); "
                      f"at most {b * one / p['step']:.2f}x one row's throughput")
                name = f"step_bound.{model}.{'fp8' if fp8 else 'bf16'}"
                figures |= {f"{name}.step_ms.{x}{b}": p["step"] * 1e3, f"{name}.gain.{x}{b}": b * one / p["step"]}
    if args.results_dir is not None:
        from benchmarks import results

        results.write(figures, "step_bound", card=f"modelled: {args.tbps:g} TB/s, {args.tflops:g} TFLOP/s BF16",
                      command=f"python -m benchmarks.step_bound --tflops {args.tflops:g} --tbps {args.tbps:g} "
                              f"--keys {args.keys}", results_dir=args.results_dir)


if __name__ == "__main__":
    main()
