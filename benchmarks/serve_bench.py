"""Load-test any OpenAI-compatible completions server; report what `vllm bench serve` reports, plus diffusion.

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --max-concurrency 1,4,16 --random-input-len 256 --random-output-len 128 --ignore-eos \\
        [--mix nemotron-ld] [--save-result result.json] [--results-dir benchmarks/results]

Streamed requests of random prompts (or drawn per request from a mix: benchmarks/request_mix.py), at most
--max-concurrency in flight, one run per value of a comma list. Per run: the Serving Benchmark Result
(throughput; TTFT, TPOT and ITL percentiles, ITL per streamed chunk: one committed block on a diffusion
server) and, when the server reports `usage.diffusion`, a Diffusion Decoding block. Needs the `bench`
extra. docs/benchmarking.md has every option.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks.bench_prompts import FALLBACK_VOCAB, Prompts, load_tokenizer, text_prompts, token_id_prompts
from benchmarks.bench_stats import LATENCY_METRICS, RequestResult, format_report, format_sweep, summarize
from benchmarks.request_mix import NAMES, Draw, MixError, load_mix

DEFINITIONS = {
    "ttft": "time from sending a request to its first streamed chunk with choices (its text may be \"\": "
            "tokens that decode to no text yet still arrived)",
    "itl": "gap between consecutive streamed chunks with choices (one chunk = one committed block on a "
           "diffusion server)",
    "tpot": "(end-to-end latency - TTFT) / (output tokens - 1), per request",
    "e2el": "time from sending a request to the end of its stream",
    "committed_throughput": "committed tokens (usage.completion_tokens of requests with usage.diffusion) / duration",
}
MIX_HELP = ("draw each request's prompt length, max_tokens and options: a built-in mix (" + ", ".join(NAMES) +
            ": every option a user may send to that family) or a JSON-lines file, one kind of request per line, "
            "e.g. "
            '{"weight": 1, "prompt_len": {"uniform": [16, 300]}, "max_tokens": {"choice": [32, 128]}, '
            '"temperature": {"choice": [0, 1]}, "diffusion.mode": "ar"}: weight (default 1) picks the line, '
            "prompt_len and max_tokens are required, every other key is a request field (dotted for nested); "
            "a value is a constant (null: left out), {\"choice\": [...]} or {\"uniform\": [lo, hi]} "
            "(integers: inclusive). Draws follow --seed. Replaces --random-input-len, --random-output-len "
            "and --temperature; `python -m benchmarks.request_mix NAME` prints a built-in one")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without the endpoint path")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", help="the served model name (default: the first one GET /v1/models lists)")
    p.add_argument("--tokenizer", help="path or cached hub name, loaded offline (default: --model); "
                                       "without one, prompts are random token ids")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--random-vocab-size", type=int, default=FALLBACK_VOCAB,
                   help="token-id prompts (no tokenizer) draw ids from [0, this)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (dllm-serve, vLLM)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy, as vLLM's benchmark")
    p.add_argument("--mix", metavar="NAME|FILE", help=MIX_HELP)
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request (over --mix), e.g. '
                        '\'{"diffusion": {"policy": "low_confidence"}}\'')
    p.add_argument("--max-concurrency", type=_concurrencies, default=[None],
                   help="requests in flight at most; a comma list (1,4,16) runs one benchmark per value")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", type=_floats, default=[99.0], help="comma list, default 99")
    p.add_argument("--percentile-metrics", type=_metrics, default=["ttft", "tpot", "itl"],
                   help=f"comma list of {','.join(LATENCY_METRICS)}, default ttft,tpot,itl")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--save-result", type=Path, help="write the results of every run as JSON here")
    p.add_argument("--plot", type=Path, help="PNG of the sweep (default: the --save-result path with .png)")
    p.add_argument("--results-dir", type=Path, help="also write the figures as a result file there "
                   "(benchmarks/results.py; e.g. benchmarks/results): of this checkout's commit on --card")
    p.add_argument("--card", help="the server's device, named in the result file (default: this machine's, "
                                  "right for a local server)")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.mix is not None:
        try:
            load_mix(args.mix)
        except MixError as err:
            p.error(f"--mix: {err}")
    if args.plot is None and args.save_result is not None:
        args.plot = args.save_result.with_suffix(".png")
    return args


def _concurrencies(text: str) -> list[int | None]:
    values = [None if v.strip().lower() in ("none", "inf") else int(v) for v in text.split(",")]
    if any(v is not None and v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1: {text}")
    return values


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def _metrics(text: str) -> list[str]:
    keys = [v.strip() for v in text.split(",")]
    bad = [k for k in keys if k not in LATENCY_METRICS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown metrics {bad}; choose from {list(LATENCY_METRICS)}")
    return keys


# ------------------------------------------------------------------------------------------ requests


async def send(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int, tokenizer) -> RequestResult:
    """One streamed completion, timed at every chunk with choices. dllm-serve sends one only with tokens
    or the finish reason, and its text can be "" while it carries tokens (special tokens, a character
    not complete yet): such a chunk counts as vLLM's benchmark counts it."""
    res = RequestResult(input_tokens=prompt_len)
    text = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - start
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"in stream: {msg['error'].get('message', msg['error'])}"
                    return res
                choices = msg.get("choices") or []
                if choices:
                    res.chunk_times.append(now)
                text += [choice.get("text") or "" for choice in choices]
                if msg.get("usage"):
                    res.usage = msg["usage"]
        res.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
        return res
    res.ok = True
    if res.usage:
        res.input_tokens, res.output_tokens = res.usage["prompt_tokens"], res.usage["completion_tokens"]
    elif tokenizer is not None:  # a server that ignores include_usage: count the text ourselves
        res.output_tokens = len(tokenizer.encode("".join(text), add_special_tokens=False))
    return res


def request_body(args: argparse.Namespace, model: str, prompt, draw: Draw | None = None) -> dict:
    """A streamed completion: --random-output-len and --temperature, or the request's draw of --mix."""
    if draw is None:
        body = {"model": model, "prompt": prompt, "max_tokens": args.random_output_len,
                "temperature": args.temperature}
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": draw.max_tokens, **draw.options}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    return merge(body, args.extra_body)


def merge(body: dict, extra: dict) -> dict:
    """`extra` over `body`, objects merged field by field (an --extra-body diffusion option keeps the mix's)."""
    out = dict(body)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def run_level(client: httpx.AsyncClient, url: str, bodies: list[dict], prompt_lens: list[int], tokenizer,
                    concurrency: int | None, *, request_rate: float = math.inf, seed: int = 0,
                    percentiles=(99.0,), progress: bool = True) -> dict:
    """One benchmark: every body once, at most `concurrency` in flight, arrivals at `request_rate`."""
    gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    rng = np.random.default_rng(seed)
    bar = tqdm(total=len(bodies), desc=f"concurrency {concurrency or 'none'}", disable=not progress,
               file=sys.stderr)

    async def one(body: dict, prompt_len: int) -> RequestResult:
        async with gate:
            res = await send(client, url, body, prompt_len, tokenizer)
        bar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for body, n in zip(bodies, prompt_lens):
        tasks.append(asyncio.create_task(one(body, n)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return summarize(results, duration, concurrency, request_rate, list(percentiles))


async def served_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        r = await client.get(f"{base}/v1/models")
        r.raise_for_status()
    except httpx.HTTPError as err:
        raise SystemExit(f"could not list the models at {base}/v1/models ({type(err).__name__}: {err}); "
                         "is the server up? --model skips this") from None
    return r.json()["data"][0]["id"]


# ----------------------------------------------------------------------------------------------- main


def make_prompts(args: argparse.Namespace, tokenizer, lengths: list[int] | None = None) -> Prompts:
    """--num-prompts prompts of --random-input-len tokens, or of `lengths` (one per prompt)."""
    rng = np.random.default_rng(args.seed)
    length = args.random_input_len if lengths is None else lengths
    if tokenizer is not None:
        return text_prompts(tokenizer, args.num_prompts, length, rng)
    return token_id_prompts(args.num_prompts, length, args.random_vocab_size, rng)


def draw_mix(args: argparse.Namespace) -> list[Draw] | None:
    """Each request's draw of --mix (None without one), from its own stream of --seed: the prompts'
    random tokens stay those of the same seed without a mix."""
    if args.mix is None:
        return None
    return load_mix(args.mix).draw(args.num_prompts, np.random.default_rng([args.seed, 1]))


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


async def bench(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/").removesuffix("/v1")  # accept an OpenAI client's base URL too
    url = base + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection cap: httpx's default of 100 would silently bound the concurrency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.request_timeout, limits=limits) as client:
        model = args.model or await served_model(client, base)
        tokenizer = load_tokenizer(args.tokenizer or model)
        if tokenizer is None and args.tokenizer:  # asked for by name: falling back would hide a typo
            raise SystemExit(f"no tokenizer at {args.tokenizer} (loaded offline: a directory or a cached hub name)")
        draws = draw_mix(args)
        prompts = make_prompts(args, tokenizer, None if draws is None else [d.prompt_len for d in draws])
        bodies = [request_body(args, model, p, None if draws is None else draws[i])
                  for i, p in enumerate(prompts.prompts)]
        max_tokens = _span([b["max_tokens"] for b in bodies])
        lengths = f"{_span(prompts.lens)} input / {max_tokens} output tokens"
        print(f"Model: {model}\nPrompts: {args.num_prompts} x {prompts.source}\n"
              f"Output: max_tokens={max_tokens}{', ignore_eos' if args.ignore_eos else ''}\n"
              + (f"Options: drawn per request from the {load_mix(args.mix).describe()}\n" if draws else "") +
              "ITL is per streamed chunk (on a diffusion server, one committed block); TPOT is per token.")
        check = await send(client, url, bodies[0], prompts.lens[0], tokenizer)  # fail fast; warms the server up
        if not check.ok:
            raise SystemExit(f"the test request to {url} failed: {check.error}")
        print(f"Test request: ok, {check.output_tokens} tokens in {check.latency:.2f} s")
        summaries = []
        for concurrency in args.max_concurrency:
            print(f"\nTraffic request rate: {args.request_rate}\nMaximum request concurrency: {concurrency}",
                  flush=True)
            summary = await run_level(client, url, bodies, prompts.lens, tokenizer, concurrency,
                                      request_rate=args.request_rate, seed=args.seed,
                                      percentiles=args.metric_percentiles, progress=not args.disable_tqdm)
            print(format_report(summary, args.metric_percentiles, args.percentile_metrics), flush=True)
            summaries.append(summary)
    if len(summaries) > 1:
        print("\n" + format_sweep(summaries, args.metric_percentiles[-1]))
    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "base_url": base,
            "endpoint": args.endpoint, "model": model, "prompts": prompts.source, "lengths": lengths,
            "mix": None if draws is None else {"source": args.mix, "lines": load_mix(args.mix).lines,
                                               "draws": [vars(d) for d in draws]},
            "tokenizer": None if tokenizer is None else tokenizer.name_or_path, "definitions": DEFINITIONS,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "runs": summaries}


def figures(result: dict) -> dict[str, float | None]:
    """A result file's figures (benchmarks/results.py): `serve_bench.<model>.c<concurrency>.<figure>`,
    each level's throughputs, latency statistics and committed tokens per denoising step."""
    out = {}
    for run in result["runs"]:
        level = f"serve_bench.{result['model']}.c{run['max_concurrency'] or 'all'}"
        out |= {f"{level}.{k}": v for k, v in run.items()
                if k in ("request_throughput", "output_throughput") or re.fullmatch(r"(mean|median|p[\d.]+)_\w+_ms", k)}
        out[f"{level}.committed_per_step"] = (run["diffusion"] or {}).get("committed_per_step")
    return out


def json_safe(obj):
    """JSON has no Infinity: an infinite request rate is written as the string "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    if args.save_result is not None:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(json_safe(result), indent=1, allow_nan=False))
        print(f"Results: {args.save_result}")
    if args.results_dir is not None:
        from benchmarks import results

        results.write(figures(result), "serve_bench", card=args.card, results_dir=args.results_dir)
    if args.plot is not None:
        try:
            from benchmarks.bench_plot import plot_sweep
        except ImportError as err:  # the GPU host may have no matplotlib: the figures are in the JSON
            print(f"No plot: {err}")
        else:
            plot_sweep(result, args.plot)
            print(f"Plot: {args.plot}")
    return result


if __name__ == "__main__":
    main()
