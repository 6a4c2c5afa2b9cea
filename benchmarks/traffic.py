"""Speed under real traffic, measured from the client, from ONE cold start of a served full-size shape.

    python -m benchmarks.traffic --family nemotron-ld|diffusion-gemma [--server-tree PATH] [--warm-restart]

Starts scripts/serve_local.py of --server-tree (default: this checkout; an older one measures "before"
with the same client) on the family's full-size shapes with dummy weights, then times the cold start,
the homogeneous, matched and mixed phases at --concurrency, the seed workload per concurrency, with
--seed-schema the seed workload under a JSON schema and, with --warm-restart, a second start on the caches
the first filled. Prints the rows (mixed / homogeneous
committed tok/s, p99 / median latency, graphs captured after ready, GPU memory, passes, seed tok/s and
the shards' busy share); saves every figure as JSON (--out) and a result file (--results-dir).
docs/benchmarking.md says what each phase and row is.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from benchmarks import results
from benchmarks.bench_prompts import FALLBACK_VOCAB, token_id_prompts
from benchmarks.request_mix import NAMES, Draw, MixError, load_mix
from benchmarks.serve_bench import json_safe, request_body, run_level
from benchmarks.server_process import (REPO, SCRAPED, ServerError, ServerProcess, gpu_memory_mib,
                                       scrape_metrics, tree_commit)

FAMILIES = {"nemotron-ld": "nemotron-ld-8b", "diffusion-gemma": "diffusion-gemma-26b-a4b"}   # -> shapes dir
SEED_OPTIONS = {
    "nemotron-ld": {},
    "diffusion-gemma": {"diffusion": {"max_denoising_steps": 16, "confidence_threshold": 0, "entropy_bound": 0.1}},
}
PERCENTILES = [50.0, 99.0]
# request fields that change what a step computes (a row's mode, reveal policy, thresholds, step counts),
# kept by the matched phase; the rest of a mix (temperature, top_k, top_p, logprobs) is what an engine
# that treats options as data should serve at the homogeneous rate
ALGORITHM_FIELDS = ("diffusion",)
STREAMED = argparse.Namespace(ignore_eos=True, extra_body={})   # serve_bench.request_body's settings
FIRST_REQUEST = {"prompt": [1] * 16, "max_tokens": 16, "ignore_eos": True}   # sent until one succeeds
# --seed-schema's constraint: JSON with open-ended strings, so the grammar lets much text through, as a
# real extraction's would (after the object closes, ignore_eos keeps a request going on EOS tokens)
SEED_SCHEMA = {"type": "json_schema", "json_schema": {"name": "report", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["title", "points"],
    "properties": {"title": {"type": "string"}, "points": {"type": "array", "items": {"type": "string"}}}}}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", required=True, choices=list(FAMILIES))
    p.add_argument("--server-tree", type=Path, default=REPO,
                   help="the dllm-serve checkout whose scripts/serve_local.py is started (default: this one)")
    p.add_argument("--model", help="a checkpoint directory instead of the family's full-size shapes")
    p.add_argument("--work", type=Path, default=Path("/tmp/dllm-traffic"), help="where the shapes are written")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another serve_local argument (repeatable), e.g. max_steps_per_command=16")
    p.add_argument("--port", type=int, default=0, help="default: a free one")
    p.add_argument("--mix", help=f"a built-in mix ({', '.join(NAMES)}) or a JSON-lines file (python -m "
                                 "benchmarks.serve_bench --help says what a line is); default: --family's")
    p.add_argument("--seed", type=int, default=0, help="draws of the mix and the prompts")
    p.add_argument("--concurrency", type=int, default=8, help="of the warm-up, homogeneous and mixed phases")
    p.add_argument("--requests", type=int, default=32, help="of the homogeneous and of the mixed phase")
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--seed-levels", type=_ints, default=[1, 2, 4, 8], help="comma list of concurrencies")
    p.add_argument("--seed-rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    p.add_argument("--seed-prompt-len", type=int, default=1024)
    p.add_argument("--seed-max-tokens", type=int, default=1024)
    p.add_argument("--seed-schema", action="store_true",
                   help="after the seed levels, the seed workload with a JSON schema (response_format) at "
                        "concurrency 1, and unconstrained seed requests beside as many constrained ones "
                        "against beside unconstrained ones (half the highest level each)")
    p.add_argument("--vocab", type=int, default=FALLBACK_VOCAB, help="prompt token ids are drawn from [0, this)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds from the start to the first successful completion")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--phase-timeout", type=float, default=900.0, help="seconds per phase (its requests are "
                                                                      "then abandoned and the next one runs)")
    p.add_argument("--compile-cache", type=Path,
                   help="the server's inductor and triton caches (default: a new directory under --work, "
                        "removed at the end)")
    p.add_argument("--warm-restart", action="store_true",
                   help="after the phases, start the server again on the caches the first start filled")
    p.add_argument("--out", type=Path, help="the JSON (default: $OUT or . / traffic-FAMILY.json)")
    p.add_argument("--log", type=Path, help="the server's log (default: beside --out, -server.log)")
    p.add_argument("--results-dir", type=results.directory, default=results.DEFAULT_DIR,
                   help="where the result file goes (benchmarks/results.py; default: $OUT where set, else "
                        "benchmarks/results); '' writes none")
    p.add_argument("--progress", action="store_true", help="progress bars on stderr")
    opts = p.parse_args(argv)
    opts.mix = opts.mix or opts.family
    try:
        load_mix(opts.mix)
    except MixError as err:
        p.error(f"--mix: {err}")
    if opts.out is None:
        opts.out = Path(os.environ.get("OUT", ".")) / f"traffic-{opts.family}.json"
    if opts.log is None:
        opts.log = opts.out.with_name(opts.out.stem + "-server.log")
    return opts


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1: {text}")
    return values


# ---- what is sent ------------------------------------------------------------------------------------

def write_model(family: str, work: Path) -> Path:
    from benchmarks.shapes import write_diffusion_gemma_shapes, write_shapes   # transformers, torch: only here

    out = work / FAMILIES[family]
    return write_shapes(out) if family == "nemotron-ld" else write_diffusion_gemma_shapes(out)


def server_args(opts: argparse.Namespace) -> list[str]:
    return [f"load_format={opts.load_format}", f"max_num_seqs={opts.max_num_seqs}", *opts.server_arg]


def token_prompts(lens: list[int], vocab: int, seed) -> list[list[int]]:
    return token_id_prompts(len(lens), lens, vocab, np.random.default_rng(seed)).prompts


def plan(opts: argparse.Namespace, model: str) -> dict[str, list[dict]]:
    """Every phase's request bodies, drawn from --seed alone (so before and after send the same)."""
    mix = load_mix(opts.mix)
    draws = mix.draw(opts.requests, np.random.default_rng([opts.seed, 1]))
    warm = mix.draw(opts.warmup_requests, np.random.default_rng([opts.seed, 2]))
    prompts = token_prompts([d.prompt_len for d in draws], opts.vocab, [opts.seed, 3])
    warm_prompts = token_prompts([d.prompt_len for d in warm], opts.vocab, [opts.seed, 4])
    seed_n = 1 + sum(c * opts.seed_rounds for c in opts.seed_levels)
    seed_prompts = token_prompts([opts.seed_prompt_len] * seed_n, opts.vocab, [opts.seed, 5])
    seed_draw = Draw(opts.seed_prompt_len, opts.seed_max_tokens, SEED_OPTIONS[opts.family])

    def plain(d: Draw) -> Draw:
        return Draw(d.prompt_len, d.max_tokens, {})

    def matched(d: Draw) -> Draw:
        return Draw(d.prompt_len, d.max_tokens, {k: v for k, v in d.options.items() if k in ALGORITHM_FIELDS})

    bodies = {"warmup": [request_body(STREAMED, model, p, plain(d)) for p, d in zip(warm_prompts, warm)],
              "homogeneous": [request_body(STREAMED, model, p, plain(d)) for p, d in zip(prompts, draws)],
              "matched": [request_body(STREAMED, model, p, matched(d)) for p, d in zip(prompts, draws)],
              "mixed": [request_body(STREAMED, model, p, d) for p, d in zip(prompts, draws)],
              "seed": [request_body(STREAMED, model, p, seed_draw) for p in seed_prompts]}
    if bodies["matched"] == bodies["homogeneous"]:   # the mix draws no algorithm option: nothing to part
        del bodies["matched"]
    if opts.seed_schema:
        half = max(1, max(opts.seed_levels) // 2)
        n = [opts.seed_rounds, half * opts.seed_rounds]
        more = token_prompts([opts.seed_prompt_len] * (n[0] + 4 * n[1]), opts.vocab, [opts.seed, 6])
        plain = [request_body(STREAMED, model, p, seed_draw) for p in more]
        bound = [b | {"response_format": SEED_SCHEMA} for b in plain]
        cut = [n[0], n[0] + n[1], n[0] + 2 * n[1], n[0] + 3 * n[1]]
        bodies |= {"schema_c1": bound[:cut[0]], "beside_plain_free": plain[cut[0]:cut[1]],
                   "beside_plain_other": plain[cut[1]:cut[2]], "beside_schema_free": plain[cut[2]:cut[3]],
                   "beside_schema_other": bound[cut[3]:]}
    return bodies


# ---- the measurement ---------------------------------------------------------------------------------

def compile_cache_env(cache: Path) -> dict[str, str]:
    """The environment that puts a server's inductor and triton caches under `cache`."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}


def measure(opts: argparse.Namespace) -> dict:
    """One server start, every phase (and with --warm-restart a second start); the result (also written
    to --out, after each phase too). The server is stopped at the end, also on an error or
    KeyboardInterrupt."""
    model = Path(opts.model) if opts.model else write_model(opts.family, opts.work)
    opts.work.mkdir(parents=True, exist_ok=True)
    cache = opts.compile_cache or Path(tempfile.mkdtemp(prefix="compile-cache-", dir=opts.work))
    try:
        return _starts(opts, model, cache)
    finally:
        if opts.compile_cache is None:   # ours: a measurement's caches, not a user's
            shutil.rmtree(cache, ignore_errors=True)


def _starts(opts: argparse.Namespace, model: Path, cache: Path) -> dict:
    env = compile_cache_env(cache)
    server = ServerProcess(opts.server_tree, str(model), server_args(opts), opts.log, opts.port, env)
    result = {"family": opts.family, "date": datetime.now().astimezone().isoformat(timespec="seconds"),
              "server_tree": str(server.tree), "server_commit": tree_commit(server.tree),
              "server_command": server.command, "server_log": str(opts.log), "mix": opts.mix,
              "compile_cache": str(cache),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
              "cold_start": None, "phases": {}, "seed": {}, "warm_start": None, "rows": None}
    try:
        server.start()
        result["server_pid"] = server.proc.pid
        asyncio.run(_phases(opts, server, result))
    finally:
        result["server_exit_status"] = server.stop()
        result["rows"] = derive(result, opts.seed_levels)
        save(result, opts.out)
    if opts.warm_restart:
        again = ServerProcess(opts.server_tree, str(model), server_args(opts), warm_log(opts.log), opts.port, env)
        try:
            again.start()
            result["warm_server_pid"] = again.proc.pid
            result["warm_start"] = asyncio.run(_warm_start(opts, again))
        finally:
            result["warm_server_exit_status"] = again.stop()
            save(result, opts.out)
    return result


def warm_log(log: Path) -> Path:
    """The second start's log, beside the first's."""
    return log.with_name(log.stem + "-warm" + log.suffix)


async def _warm_start(opts: argparse.Namespace, server: ServerProcess) -> dict:
    async with httpx.AsyncClient(timeout=opts.request_timeout) as http:
        out = await server.wait_ready(http, opts.start_timeout, FIRST_REQUEST)
    print(f"{opts.family}: warm start: /health 200 at {out['health_200_s']:.1f} s, first completion at "
          f"{out['first_completion_s']:.1f} s", flush=True)
    return out


async def _phases(opts: argparse.Namespace, server: ServerProcess, result: dict) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=opts.request_timeout, limits=limits) as http:
        result["cold_start"] = await server.wait_ready(http, opts.start_timeout, FIRST_REQUEST)
        model = result["model"] = result["cold_start"]["model"]
        result["cold_start"]["gpu_memory_mib"] = await asyncio.to_thread(gpu_memory_mib)
        print(f"{opts.family}: /health 200 at {result['cold_start']['health_200_s']:.1f} s, first completion at "
              f"{result['cold_start']['first_completion_s']:.1f} s", flush=True)
        save(result, opts.out)
        bodies = plan(opts, model)
        url = server.base + "/v1/completions"
        for name in ("warmup", "homogeneous", "matched", "mixed"):
            if name in bodies:
                result["phases"][name] = await run_phase(http, server, url, name, bodies[name], opts.concurrency,
                                                         opts)
            save(result, opts.out)
        seed = bodies["seed"]
        result["seed"]["warmup"] = await run_phase(http, server, url, "seed warm-up", seed[:1], 1, opts)
        taken = 1
        for level in opts.seed_levels:
            n = level * opts.seed_rounds
            result["seed"][str(level)] = await run_phase(http, server, url, f"seed at concurrency {level}",
                                                         seed[taken:taken + n], level, opts)
            taken += n
            save(result, opts.out)
        if opts.seed_schema:
            await _schema_phases(opts, http, server, url, bodies, result)


async def _schema_phases(opts: argparse.Namespace, http: httpx.AsyncClient, server: ServerProcess, url: str,
                         bodies: dict, result: dict) -> None:
    """The seed workload with a JSON schema at concurrency 1; then unconstrained seed requests (`free`)
    sent beside as many others (`other`), unconstrained and then constrained, each group at half the
    highest level: the free group's tok/s beside constrained neighbours over beside unconstrained ones."""
    schema = result["schema"] = {}
    schema["c1"] = await run_phase(http, server, url, "seed with a JSON schema at concurrency 1",
                                   bodies["schema_c1"], 1, opts)
    half = max(1, max(opts.seed_levels) // 2)
    for kind in ("plain", "schema"):
        free, other = await asyncio.gather(
            run_phase(http, server, url, f"seed beside {kind} neighbours", bodies[f"beside_{kind}_free"], half,
                      opts),
            run_phase(http, server, url, f"  its {kind} neighbours", bodies[f"beside_{kind}_other"], half, opts))
        schema[f"beside_{kind}_free"], schema[f"beside_{kind}_other"] = free, other
        save(result, opts.out)


async def run_phase(http: httpx.AsyncClient, server: ServerProcess, url: str, name: str, bodies: list[dict],
                    concurrency: int, opts: argparse.Namespace) -> dict:
    """The bodies at `concurrency`, bounded by --phase-timeout; its summary (serve_bench's), the
    CUDA-graph series before and after, and the GPU memory after."""
    before = await scrape_metrics(http, server.base)
    t = time.monotonic()
    summary, error = None, None
    try:
        summary = await asyncio.wait_for(
            run_level(http, url, bodies, [len(b["prompt"]) for b in bodies], None, concurrency, seed=opts.seed,
                      percentiles=PERCENTILES, progress=opts.progress), opts.phase_timeout)
    except asyncio.TimeoutError:
        error = f"timed out after {opts.phase_timeout:.0f} s"
    after = await scrape_metrics(http, server.base)
    memory = await asyncio.to_thread(gpu_memory_mib)
    out = {"concurrency": concurrency, "requests": len(bodies), "wall_s": time.monotonic() - t, "error": error,
           "memory_after_mib": memory, "metrics_before": before, "metrics_after": after,
           "metrics_delta": {k: None if before[k] is None or after[k] is None else after[k] - before[k]
                             for k in SCRAPED},
           "summary": summary}
    if summary is None:
        print(f"  {name}: {error}", flush=True)
    else:
        errors = sorted({e for e in summary["errors"] if e})
        captures = out["metrics_delta"]["dllm_graph_captures_total"]
        print(f"  {name}: {summary['completed']}/{len(bodies)} ok in {summary['duration']:.1f} s, "
              f"{summary['output_throughput']:.0f} tok/s, latency median {summary['median_e2el_ms'] / 1e3:.2f} s "
              f"p99 {summary['p99_e2el_ms'] / 1e3:.2f} s, graphs captured +{_fmt(captures)}, GPU memory "
              f"{_fmt(memory)} MiB" + (f"; errors: {errors[:3]}" if errors else ""), flush=True)
    return out


# ---- the rows ----------------------------------------------------------------------------------------

def _tok_s(phase: dict | None) -> float | None:
    """Committed tok/s: usage.completion_tokens of the phase's requests over its duration."""
    s = (phase or {}).get("summary")
    return s["output_throughput"] if s and s["completed"] else None


def _delta(phase: dict | None, name: str) -> float | None:
    """A counter's growth over a phase (None where the phase or the series is missing)."""
    return (phase.get("metrics_delta") or {}).get(name) if phase else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms_per_pass(phase: dict | None, passes: float | None) -> float | None:
    """The phase's duration (tok/s's own: first request sent to last answered) over its passes."""
    s = (phase or {}).get("summary")
    return _ratio(s["duration"] * 1e3, passes) if s and s.get("duration") is not None else None


def derive(result: dict, levels: list[int]) -> dict:
    """The rows from the phases measured so far (None where a phase is missing)."""
    phases, seed, schema = result["phases"], result["seed"], result.get("schema") or {}
    mixed = (phases.get("mixed") or {}).get("summary")
    last = None   # the latest scrape of the CUDA-graph series
    for rec in [*phases.values(), *seed.values(), *schema.values()]:
        last = rec["metrics_after"]
    memory = {name: rec["memory_after_mib"] for name, rec in phases.items()}
    tok_s = {name: _tok_s(phases.get(name)) for name in ("homogeneous", "matched", "mixed")}
    passes = {name: _delta(phases.get(name), "dllm_passes_total") for name in ("homogeneous", "matched", "mixed")}
    forwards = {name: _delta(phases.get(name), "dllm_forwards_total") for name in passes}
    seed_tok_s = {str(c): _tok_s(seed.get(str(c))) for c in levels}
    seed_passes = {str(c): _delta(seed.get(str(c)), "dllm_passes_total") for c in levels}
    failed = sum(rec["summary"]["failed"] if rec["summary"] else rec["requests"]
                 for rec in [*phases.values(), *seed.values(), *schema.values()])
    return {
        "homogeneous_tok_s": tok_s["homogeneous"],
        "mixed_tok_s": tok_s["mixed"],
        "mixed_over_homogeneous": _ratio(tok_s["mixed"], tok_s["homogeneous"]),
        "matched_tok_s": tok_s["matched"],
        "mixed_over_matched": _ratio(tok_s["mixed"], tok_s["matched"]),
        "matched_over_homogeneous": _ratio(tok_s["matched"], tok_s["homogeneous"]),
        "mixed_latency_median_s": mixed["median_e2el_ms"] / 1e3 if mixed and mixed["completed"] else None,
        "mixed_latency_p99_s": mixed["p99_e2el_ms"] / 1e3 if mixed and mixed["completed"] else None,
        "mixed_p99_over_median": _ratio(mixed["p99_e2el_ms"], mixed["median_e2el_ms"]) if mixed else None,
        # the same tokens in each phase: how many weight reads (passes) each took, and the rows a pass carried
        "passes": passes,
        "rows_per_pass": {name: _ratio(forwards[name], passes[name]) for name in passes},
        # the phase's duration over its passes: with every slot busy, about a step's time (what the
        # options cost a step is mixed's minus homogeneous's, at their rows a pass)
        "ms_per_pass": {name: _ms_per_pass(phases.get(name), passes[name]) for name in passes},
        "mixed_over_homogeneous_passes": _ratio(passes["mixed"], passes["homogeneous"]),
        "graph_captures_after_ready": None if last is None else last["dllm_graph_captures_total"],
        "eager_steps_while_serving": None if last is None else last["dllm_eager_steps_total"],
        "kernel_compiles_while_serving": None if last is None else last["dllm_kernel_compiles_total"],
        "cuda_graphs": None if last is None else last["dllm_cuda_graphs"],
        "cuda_graph_memory_mib": None if last is None or last["dllm_cuda_graph_memory_bytes"] is None
        else last["dllm_cuda_graph_memory_bytes"] / 2**20,
        "gpu_memory_after_warmup_mib": memory.get("warmup"),
        "gpu_memory_after_mixed_mib": memory.get("mixed"),
        "gpu_memory_mixed_minus_warmup_mib": None if memory.get("mixed") is None or memory.get("warmup") is None
        else memory["mixed"] - memory["warmup"],
        "failed_requests": failed,
        "seed_tok_s": seed_tok_s,
        "seed_over_concurrency_1": {c: _ratio(v, seed_tok_s.get("1")) for c, v in seed_tok_s.items()},
        "seed_ms_per_pass": {c: _ms_per_pass(seed.get(c), n) for c, n in seed_passes.items()},
        "seed_rows_per_pass": {c: _ratio(_delta(seed.get(c), "dllm_forwards_total"), n)
                               for c, n in seed_passes.items()},
        # the share of the phase's duration the shards spent executing commands: 1 - it is the time the
        # GPU waited on the host (HTTP, Ray, the scheduler), an upper bound since a command's execute
        # time also covers its own host work
        "seed_busy_share": {str(c): _busy_share(seed.get(str(c))) for c in levels},
        # --seed-schema: a constrained request's own cost, and what constrained neighbours cost the others
        "seed_schema_over_plain_c1": _ratio(_tok_s(schema.get("c1")), seed_tok_s.get("1")),
        "schema_neighbours_ratio": _ratio(_tok_s(schema.get("beside_schema_free")),
                                          _tok_s(schema.get("beside_plain_free"))),
    }


def _busy_share(phase: dict | None) -> float | None:
    s = (phase or {}).get("summary")
    return _ratio(_delta(phase, "dllm_shard_busy_seconds_total"), s and s.get("duration"))


def rows(result: dict) -> list[tuple[str, float | None, str]]:
    """(name, value, target) of the table; roofline prints the same rows."""
    r, cold, warm = result["rows"] or {}, result["cold_start"] or {}, result.get("warm_start") or {}
    out = [("cold start: seconds to GET /health 200", cold.get("health_200_s"), ""),
           ("cold start: seconds to the first completion", cold.get("first_completion_s"), ""),
           ("warm start: seconds to GET /health 200", warm.get("health_200_s"), ""),
           ("homogeneous committed tok/s", r.get("homogeneous_tok_s"), ""),
           ("mixed committed tok/s", r.get("mixed_tok_s"), ""),
           ("mixed / homogeneous committed tok/s", r.get("mixed_over_homogeneous"), ">= 0.9")]
    if r.get("matched_tok_s") is not None:
        out += [("  mixed / matched (the options' own cost)", r.get("mixed_over_matched"), ""),
                ("  matched / homogeneous (the mix's modes, policies)", r.get("matched_over_homogeneous"), "")]
    for name, n in (r.get("passes") or {}).items():
        if n is not None:
            out.append((f"  {name}: passes ({_fmt(r['rows_per_pass'][name])} rows, "
                        f"{_fmt(r['ms_per_pass'][name])} ms each)", n, ""))
    out += [("p99 / median request latency under the mix", r.get("mixed_p99_over_median"), "<= 2"),
            ("graphs captured after ready", r.get("graph_captures_after_ready"), "0"),
            ("eager steps while serving", r.get("eager_steps_while_serving"), ""),
            ("kernels compiled while serving", r.get("kernel_compiles_while_serving"), "0"),
            ("GPU MiB after mixed - after warm-up", r.get("gpu_memory_mixed_minus_warmup_mib"), "about 0"),
            ("failed requests", r.get("failed_requests"), "0")]
    for c, tok_s in (r.get("seed_tok_s") or {}).items():
        out.append((f"seed workload tok/s at concurrency {c}", tok_s, ""))
        if c != "1":
            out.append((f"seed workload tok/s at concurrency {c} / at 1", r["seed_over_concurrency_1"][c], ""))
        ms = (r.get("seed_ms_per_pass") or {}).get(c)
        if ms is not None:
            out.append((f"seed at concurrency {c}: ms a pass ({_fmt(r['seed_rows_per_pass'][c])} rows)", ms, ""))
        busy = (r.get("seed_busy_share") or {}).get(c)
        if busy is not None:
            out.append((f"seed at concurrency {c}: shards' busy share of the time", busy, ""))
    if r.get("seed_schema_over_plain_c1") is not None or r.get("schema_neighbours_ratio") is not None:
        out += [("seed workload with a JSON schema at concurrency 1 / without", r.get("seed_schema_over_plain_c1"),
                 ""),
                ("unconstrained tok/s beside constrained neighbours / beside unconstrained",
                 r.get("schema_neighbours_ratio"), ">= 0.95")]
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) and not float(value).is_integer() else f"{value:.0f}"


def figures(result: dict) -> dict[str, float | None]:
    """The result's figures under stable names for a result file (benchmarks/results.py):
    `traffic.<served model>.<row>`, a phase's or a level's as `.<phase>` or `.c<concurrency>`."""
    r, cold, warm = result["rows"] or {}, result["cold_start"] or {}, result.get("warm_start") or {}
    out = {"cold_start_health_200_s": cold.get("health_200_s"),
           "cold_start_first_completion_s": cold.get("first_completion_s"),
           "warm_start_health_200_s": warm.get("health_200_s")}
    for name, value in r.items():
        if isinstance(value, dict):
            level = name.startswith("seed_")
            out |= {f"{name.replace('seed_over_concurrency_1', 'seed_over_c1')}.{'c' * level}{k}": v
                    for k, v in value.items()}
        else:
            out[name] = value
    model = result.get("model") or result["family"]
    return {f"traffic.{model}.{k}": v for k, v in out.items()}


def format_table(result: dict) -> str:
    head = f"traffic {result['family']}: {result['server_tree']} @ {result['server_commit'] or '?'}"
    lines = [head, f"{'':52} {'measured':>10}  target"]
    lines += [f"{name:52} {_fmt(value):>10}  {target}" for name, value, target in rows(result)]
    return "\n".join(lines)


def save(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(result), indent=1, allow_nan=False, default=str))


def write_result(opts: argparse.Namespace, result: dict, stopped: bool = False) -> None:
    """The result's figures as a result file, where --results-dir is set (a stopped run's: only where some
    phase ended, its note saying so)."""
    got = figures(result)
    if opts.results_dir is None or (stopped and all(v is None for v in got.values())):
        return
    results.write(got, "traffic", commit=result["server_commit"], results_dir=opts.results_dir,
                  note="stopped midway: the phases that ended" if stopped else "")


def _terminate(signum, frame):
    raise KeyboardInterrupt   # the server is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = measure(opts)
    except KeyboardInterrupt:   # the phases that ended were saved as they ended: their figures still count
        print(f"interrupted: the server is stopped; what was measured is in {opts.out}", file=sys.stderr)
        if opts.out.is_file():
            write_result(opts, json.loads(opts.out.read_text()), stopped=True)
        return 130
    except ServerError as err:
        print(f"the server did not start: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(f"Results: {opts.out}\nServer log: {opts.log}")
    write_result(opts, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
