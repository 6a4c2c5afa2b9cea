"""Every triton kernel of model/kernels compiled for an H200 from a CPU machine (tests/hopper.py), over
the calls the served full-size models make: both families' shapes (benchmarks/shapes.py; the linear
layers' from the models themselves, built as fake tensors), every capture size and key bucket of the
CUDA graphs (model/graphs.py), the AR and canvas widths, both TP=1 vocabulary sizes, every option a
request can turn into a kernel's compile-time flag (filters, scores and their k, sampling, softcap,
self-conditioning's rounding), the batch-invariant mode's kernels, and BF16 and FP8 weights; and,
but with --quick, the same over the tiny models the GPU tests run (model/tiny.py).

    python -m tests.hopper_kernels [--quick] [--json FILE]

prints one line per kernel (specializations compiled, the most shared memory, registers, spills) and
the calls that failed to compile or to fit; exits 1 if any did. tests/test_hopper_compile.py runs it.
TP > 1 shapes are not covered (the vocabulary slices and column splits change only runtime integers).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

from tests.hopper import MAX_SHARED, install

MAX_LEN = 4096                  # key buckets up to here (the seed workload's 2048 and beyond)
LOGPROB_KS = (0, 1, 3, 5, 9, 20)   # every power-of-two width the scores' top-k kernel compiles for


def _ints(n: int, fill: int = 0) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.int64)


def linear_weights(shapes_dir: Path) -> set[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every weight of two or more dims of the model in `shapes_dir`, built as fake
    tensors (no memory): the linear layers, experts and embeddings the served model multiplies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.checkpoint import load_model_config
    from model.loader import build_model
    from model.parallel.group import TPGroup

    with FakeTensorMode(allow_non_fake_inputs=True):
        net = build_model(load_model_config(shapes_dir), TPGroup(), torch.bfloat16, "cpu")
        return {(tuple(p.shape), p.dtype) for p in net.parameters() if p.dim() >= 2}


def attention_calls(family: dict, quick: bool):
    """model.kernels.attention at every (capture size, width, key bucket) of a family's steps (quick: the
    smallest and largest batch, the largest bucket: each tile set and the longest loop)."""
    from model.graphs import capture_sizes, key_buckets
    from model.kernels.attention import attention
    from model.protocol import PAGE_SIZE

    slots = family["slots"]
    for layer in family["attention"]:
        hq, hkv, d, window = layer["hq"], layer["hkv"], layer["d"], layer.get("window")
        max_pages = -(-MAX_LEN // PAGE_SIZE)
        pages = torch.zeros(slots + 1, max_pages, dtype=torch.int64)
        for dtype in (torch.bfloat16, torch.float32):
            cache = torch.empty((slots * max_pages + 1) * PAGE_SIZE, hkv, d, dtype=dtype)
            for invariant in (False, True):
                for b in capture_sizes(slots) if dtype == torch.bfloat16 and not quick else (1, slots):
                    for width in family["widths"]:
                        q = torch.empty(b, width, hq, d, dtype=dtype)
                        meta = (_ints(b), _ints(b), _ints(b, width), torch.ones(b, dtype=torch.bool))
                        for keys in (MAX_LEN,) if quick else key_buckets(MAX_LEN):
                            label = f"attention d={d} hkv={hkv} b={b} L={width} keys={keys} {dtype}"
                            yield f"{label} inv={invariant}", lambda: attention(
                                q, cache, cache, *meta, d ** -0.5, window, keys=keys, page_table=pages,
                                page_size=PAGE_SIZE, invariant=invariant)


def rope_calls(family: dict, quick: bool):
    """model.kernels.qk_norm_rope as each family's attention calls it, with and without cache rows."""
    from model.attention import KVRows
    from model.kernels.qk_norm_rope import qk_rope, qkv_norm_rope

    for layer in family["attention"]:
        hq, hkv, d = layer["hq"], layer["hkv"], layer["d"]
        for b in (1, family["slots"]) if quick else (1, 2, family["slots"]):
            for width in family["widths"] + family["prefill_widths"][-1 if quick else 0:]:
                n = b * width
                q = torch.empty(b, width, hq, d, dtype=torch.bfloat16)
                k = torch.empty(b, width, hkv, d, dtype=torch.bfloat16)
                cos = sin = torch.empty(b, width, 1, d, dtype=torch.bfloat16)
                rows = torch.empty(64 + n, hkv, d, dtype=torch.bfloat16)
                for cached in (False, True):
                    cache = KVRows(rows, rows, _ints(n)) if cached else None
                    label = f"rope d={d} hkv={hkv} b={b} L={width} cache={cached}"
                    if family["qk_norm"]:
                        v = k if layer.get("k_eq_v") else torch.empty_like(k)
                        w = torch.empty(d, dtype=torch.bfloat16)
                        yield label, lambda: qkv_norm_rope(q, k, v, w, w, 1e-6, cos, sin, cache)
                    else:
                        scale = torch.empty(b, width, 1, 1, dtype=torch.float32)
                        yield label, lambda: qk_rope(q, k, cos, sin, scale, torch.empty_like(k), cache)


def vocab_calls(family: dict, quick: bool):
    """model.kernels.vocab_stats and filters over a step's logits: every flag a plan or a request sets
    (quick: a full batch of canvases, fp32 logits for the filters only, the smallest and largest top-k
    width)."""
    from model.kernels import filters
    from model.kernels.vocab_stats import triton_partials, triton_probabilities, triton_rank_top_k
    from model.parallel.group import TPGroup

    v, softcap, on_scaled = family["vocab"], family["softcap"], family["on_scaled"]
    for rows in (family["slots"],) if quick else (1, family["slots"]):
        for p in (family["widths"][0],) if quick else sorted({1, family["widths"][0]}):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.empty(rows, p, v, dtype=dtype)
                temp, top_k, top_p = torch.empty(rows), _ints(rows), torch.empty(rows)
                seed, counter, thr = _ints(rows), _ints(rows), torch.empty(rows, p)
                shape = f"rows={rows} P={p} {dtype}"
                yield f"filters {shape}", lambda: filters.triton_threshold(x, temp, top_k, top_p, 0, TPGroup(),
                                                                           softcap=softcap, on_scaled=on_scaled)
                if quick and dtype == torch.float32:   # 32-bit keys: the filters' own path
                    continue
                for has_thr in (False, True):
                    for sampling in (False, True):
                        for soft in family["soft_dtypes"]:
                            yield (f"partials {shape} thr={has_thr} sampling={sampling} soft={soft}",
                                   lambda: triton_partials(x, temp, seed, counter, 0, softcap=softcap,
                                                           threshold=thr if has_thr else None,
                                                           threshold_on_scaled=on_scaled, sampling=sampling,
                                                           soft_dtype=soft))
                    if family["renoise"]:
                        for out in (torch.bfloat16, torch.float32):
                            yield (f"probabilities {shape} thr={has_thr} out={out}",
                                   lambda: triton_probabilities(x, temp, torch.empty(rows, p), softcap=softcap,
                                                                threshold=thr if has_thr else None,
                                                                threshold_on_scaled=on_scaled,
                                                                soft_dtype=torch.bfloat16, out_dtype=out))
                for k in (0, LOGPROB_KS[-1]) if quick else LOGPROB_KS:
                    yield (f"rank_top_k {shape} k={k}",
                           lambda: triton_rank_top_k(x, torch.empty(rows, p), k, 0, asked=_ints(rows, k)))


def experts_calls(family: dict, weights: list, quick: bool):
    """The experts' routing, sort, grouped matmuls (BF16 and FP8) and combine at DiffusionGemma's token
    counts: 1-8 canvases, a prefill's widths (quick: one canvas and the largest)."""
    from model.kernels import fp8, invariant, routing
    from model.kernels.expert_combine import combine

    experts = [(s, dt) for s, dt in weights if len(s) == 3]
    if not experts:
        return
    e, k = family["experts"], family["top_k_experts"]
    # the sort at every size a step reaches, beyond the graphs' widest too (an eager prefill of several
    # long prompts): it compiles one variant per tile height, whatever the token count (cheap to check)
    for tokens in (1, 16, 256, 4096, 4112, 8192, 16400):
        ids = torch.empty(tokens, k, dtype=torch.int32)
        for block_m in sorted({invariant.GROUPED_TILES.m, fp8.EXPERT_TILES.m}):
            yield f"sort_pairs T={tokens} m={block_m}", lambda: routing.sort_pairs(ids, e, block_m)
    for tokens in (256, 4096) if quick else (1, 16, 256, 512, 1024, 2048, 4096):
        pairs = tokens * k
        for dtype in (torch.bfloat16, torch.float32):
            yield f"route T={tokens} {dtype}", lambda: routing.route(torch.empty(tokens, e, dtype=dtype),
                                                                     torch.empty(e), k)
        token, ends = _ints(pairs), torch.arange(1, e + 1, dtype=torch.int32)
        for (n_e, n, kk), wdtype in experts:
            w = torch.empty(n_e, n, kk, dtype=wdtype)
            gather = kk == family["hidden"]   # gate_up reads each pair's token row in place
            rows = token if gather else None
            x = torch.empty(tokens if gather else pairs, kk, dtype=wdtype)
            label = f"grouped {wdtype} w={list(w.shape)} T={tokens}"
            if wdtype == torch.float8_e4m3fn:
                tiles = fp8.EXPERT_TILES.gate_up if gather else fp8.EXPERT_TILES.down
                yield label, lambda: fp8.grouped_in_triton(x, torch.empty(x.shape[0]), w, torch.empty(n_e, n),
                                                           ends, rows, torch.bfloat16, tiles=tiles)
                # as the served experts read it: chunked for the tiles at load (GemmaExperts.chunk_for_kernels);
                # its shape only (chunk_weight would copy the full-size weight on the CPU for every call)
                chunks = invariant.ChunkedWeight(torch.empty(n_e, -(-n // tiles.n), tiles.n * kk, dtype=wdtype), n,
                                                 kk, tiles.n, tiles.k)
                yield f"{label} chunked", lambda: fp8.grouped_in_triton(
                    x, torch.empty(x.shape[0]), chunks, torch.empty(n_e, n), ends, rows, torch.bfloat16, tiles=tiles)
            else:
                yield label, lambda: invariant.grouped_matmul(x, w, ends, rows)
        yield f"combine T={tokens}", lambda: combine(torch.empty(pairs, family["hidden"], dtype=torch.bfloat16),
                                                     _ints(pairs), torch.empty(tokens, k))


def invariant_calls(family: dict, weights: list, quick: bool):
    """The batch-invariant mode's kernels: every dense weight (BF16 and FP8) at 1, 32 and 512 rows,
    self-conditioning's P W over the vocabulary, and the row sums and scans at the dims they see (quick:
    32 rows, the largest and smallest dims)."""
    from model.kernels import invariant

    for shape, dtype in weights:
        if len(shape) != 2 or dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            continue
        n, k = shape
        w = torch.empty(n, k, dtype=dtype)
        for m in (32,) if quick else (1, 32, 512):
            x = torch.empty(m, k, dtype=dtype)
            if dtype == torch.float8_e4m3fn:
                yield (f"matmul fp8 w={list(shape)} m={m}",
                       lambda: invariant.matmul(x, w, x_scale=torch.empty(m), w_scale=torch.empty(n),
                                                out_dtype=torch.bfloat16))
            else:
                yield f"matmul bf16 w={list(shape)} m={m}", lambda: invariant.matmul(x, w)
    if family["renoise"]:   # self-conditioning: probabilities [rows, V] @ the embedding [V, H], a transposed view
        embed = torch.empty(family["vocab"], family["hidden"], dtype=torch.bfloat16)
        for m in (512,) if quick else (256, 512):
            yield f"matmul P W m={m}", lambda: invariant.matmul(torch.empty(m, family["vocab"], dtype=torch.bfloat16),
                                                                embed.t())
    for d in (min(family["row_dims"]), max(family["row_dims"])) if quick else family["row_dims"]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty(4, d, dtype=dtype)
            for square in (False, True):
                yield f"row_sum d={d} {dtype} square={square}", lambda: invariant.row_sum(x, square=square)
            yield f"row_sum d={d} {dtype} fp64", lambda: invariant.row_sum(x, fp64=True)
            yield f"row_cumsum d={d} {dtype}", lambda: invariant.row_cumsum(x)


def quantize_calls(family: dict, weights: list, quick: bool):
    """The FP8 activations' row kernel (model.kernels.quantize), every producer at each input width an FP8
    weight reads (its block size is the compile-time part; the row count is the grid's)."""
    from model.kernels.quantize import quantize, takes

    widths = sorted({shape[-1] for shape, dtype in weights if dtype == torch.float8_e4m3fn})
    for k in widths:
        x = torch.empty(32, k, dtype=torch.bfloat16)
        if not takes(x, k):
            continue
        w = torch.empty(k, dtype=torch.bfloat16)
        gated = torch.empty(32, 2 * k, dtype=torch.bfloat16)
        yield f"quantize rows K={k}", lambda: quantize(x)
        yield f"quantize rms K={k}", lambda: quantize(x, weight=w, eps=1e-5, norm="ministral")
        yield f"quantize add_rms K={k}", lambda: quantize(x, residual=x, weight=w, eps=1e-5, norm="ministral")
        yield f"quantize gemma_rms K={k}", lambda: quantize(x, weight=w, eps=1e-6, norm="gemma")
        yield f"quantize silu K={k}", lambda: quantize(gated, gate="silu")
        yield f"quantize gelu K={k}", lambda: quantize(gated, gate="gelu")


def nemotron_dims(name: str, cfg) -> dict:
    """What the calls read of a Nemotron-LD config (model.config, as the model reads it)."""
    v, h = cfg.vocab_size, cfg.hidden_size
    return {"name": name, "slots": 16, "vocab": v, "hidden": h, "softcap": None, "on_scaled": True,
            "qk_norm": False, "soft_dtypes": (None,), "renoise": False, "widths": [cfg.block_size, 1],
            "prefill_widths": [16, 256, 1024],
            "attention": [{"hq": cfg.num_attention_heads, "hkv": cfg.num_key_value_heads, "d": cfg.head_dim}],
            "row_dims": [1, 32, 128, h, v, v // 2]}


def gemma_dims(name: str, cfg) -> dict:
    """What the calls read of a DiffusionGemma config (model.config: a sliding layer's and a full layer's
    heads as the model resolves them)."""
    canvas, v, h, hq = cfg.canvas_length, cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads
    full = cfg.layer_type_list.index("full_attention")
    sliding = cfg.layer_type_list.index("sliding_attention")
    return {"name": name, "slots": 8, "vocab": v, "hidden": h, "softcap": cfg.final_logit_softcapping,
            "on_scaled": False, "qk_norm": True, "soft_dtypes": (None, torch.bfloat16), "renoise": True,
            "widths": [canvas], "prefill_widths": [16, 256, 1024], "experts": cfg.num_experts,
            "top_k_experts": cfg.top_k_experts,
            "attention": [{"hq": hq, "hkv": cfg.layer_num_kv_heads(sliding), "d": cfg.layer_head_dim(sliding),
                           "window": cfg.sliding_window},
                          {"hq": hq, "hkv": cfg.layer_num_kv_heads(full), "d": cfg.layer_head_dim(full),
                           "k_eq_v": cfg.attention_k_eq_v}],
            "row_dims": [1, 8, cfg.num_experts, canvas, h, v, v // 2]}


def families(work: Path, tiny: bool) -> list[tuple[dict, list]]:
    """Each family's dims and its BF16 and FP8 weights' shapes: the served full-size ones (the published
    configs, benchmarks/shapes.py), and with `tiny` the tiny models the GPU tests run (model/tiny.py)."""
    from benchmarks.shapes import write_diffusion_gemma_shapes, write_fp8_dynamic, write_shapes
    from model.checkpoint import load_model_config
    from model.tiny import write_diffusion_gemma, write_nemotron_ld

    dirs = [("nemotron", nemotron_dims, write_shapes(work / "nemotron", tokenizer=False)),
            ("gemma", gemma_dims, write_diffusion_gemma_shapes(work / "gemma", tokenizer=False))]
    if tiny:
        dirs += [("tiny-nemotron", nemotron_dims, write_nemotron_ld(work / "tiny-nemotron")),
                 ("tiny-gemma", gemma_dims, write_diffusion_gemma(work / "tiny-gemma"))]
    out = []
    for name, dims, shapes in dirs:
        fp8 = write_fp8_dynamic(shapes, work / f"{name}-fp8")
        family = dims(name, load_model_config(shapes))
        out.append((family, sorted(linear_weights(shapes) | linear_weights(fp8), key=str)))
    return out


def defined_kernels() -> set[str]:
    """The name of every kernel model/kernels launches (its @triton.jit functions named *_kernel; the
    others are device functions those call)."""
    import importlib
    import pkgutil

    import model.kernels
    from triton.runtime.jit import JITFunction

    names = set()
    for info in pkgutil.iter_modules(model.kernels.__path__):
        module = importlib.import_module(f"model.kernels.{info.name}")
        names |= {f.fn.__name__ for f in vars(module).values()
                  if isinstance(f, JITFunction) and f.fn.__name__.endswith("_kernel")}
    return names


def census(quick: bool = False) -> dict:
    """Runs every call (quick: a subset that still compiles every kernel with each of its tile sets and
    flags the served path sets, at the largest shapes) and reports what compiled and what failed. Each
    call runs as soon as it is yielded: the generators' lambdas read their loops' current values."""
    compile_only = install()
    failures, calls, seconds = [], 0, defaultdict(float)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        for family, weights in families(Path(work), tiny=not quick):
            for gen in (attention_calls(family, quick), rope_calls(family, quick), vocab_calls(family, quick),
                        experts_calls(family, weights, quick), invariant_calls(family, weights, quick),
                        quantize_calls(family, weights, quick)):
                for label, call in gen:
                    calls += 1
                    t = time.perf_counter()
                    try:
                        call()
                    except Exception as e:   # every failure is reported, not just the first
                        failures.append(f"{family['name']}: {label}: "
                                        + "".join(traceback.format_exception_only(e)).strip()[-1500:])
                    seconds[label.split()[0]] += time.perf_counter() - t
    kernels = defaultdict(list)
    for c in compile_only.compiled:
        kernels[c.kernel].append(c)
    return {"seconds": round(time.perf_counter() - start, 1), "calls": calls, "launches": compile_only.launches,
            "failures": failures, "max_shared": MAX_SHARED, "defined": sorted(defined_kernels()),
            "seconds_by_call": {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
            "kernels": {name: {"specializations": len(cs), "shared": max(c.shared for c in cs),
                               "registers": max(c.registers for c in cs), "spilled": max(c.spilled for c in cs),
                               "warps": sorted({c.warps for c in cs}),
                               # specializations of 2+ pipeline stages whose loads are all synchronous
                               "staged_unpipelined": sum(c.stages >= 2 and not c.async_copies for c in cs),
                               "mma": {ops: sorted({" ".join(c.mma) or "none" for c in cs if c.operands == ops})
                                       for ops in sorted({c.operands for c in cs})}}
                        for name, cs in sorted(kernels.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--quick", action="store_true", help="the subset the CPU suite compiles (census())")
    args = ap.parse_args()
    result = census(args.quick)
    for name, k in result["kernels"].items():
        mma = "; ".join(f"{ops}: {', '.join(m)}" for ops, m in k["mma"].items() if m != ["none"])
        print(f"{name:24s} {k['specializations']:4d} compiled  shared <= {k['shared']:6d} B  registers <= "
              f"{k['registers']:3d}  spilled <= {k['spilled']} B  warps {k['warps']}  {mma}")
    print(f"{result['calls']} calls, {result['launches']} launches, {result['seconds']} s: "
          f"{result['seconds_by_call']}")
    for f in result["failures"]:
        print("FAILED", f)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
