"""Load-test any OpenAI-compatible completions server; report what `vllm bench serve` reports, plus diffusion.

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --max-concurrency 1,4,16 --random-input-len 256 --random-output-len 128 --ignore-eos \\
        --tokenizer ~/.cache/dllm-serve/tiny-nemotron-ld --save-result result.json

Sends `--num-prompts` streamed completions (`stream: true` with `stream_options.include_usage`) of
random prompts, at most `--max-concurrency` at a time and, with `--request-rate`, arriving as a
Poisson process (default: all at once). A comma list of concurrencies runs one benchmark per value on
the same prompts. Per run it prints the Serving Benchmark Result (throughput; TTFT, TPOT, ITL
percentiles) and, when the server reports `usage.diffusion`, a Diffusion Decoding block. ITL is
measured per streamed chunk, which on a diffusion server is one committed block; TPOT per token (the
definitions are in benchmarks/bench_stats.py). `--save-result` writes every figure of every run with
the arguments as JSON; `--plot` (default: beside the JSON) draws throughput and latency against
concurrency. Needs the `bench` extra (`pip install -e '.[bench]'`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks.bench_prompts import FALLBACK_VOCAB, Prompts, load_tokenizer, text_prompts, token_id_prompts
from benchmarks.bench_stats import LATENCY_METRICS, RequestResult, format_report, format_sweep, summarize

DEFINITIONS = {
    "ttft": "time from sending a request to its first streamed chunk with output",
    "itl": "gap between consecutive streamed chunks with output (one chunk = one committed block on a "
           "diffusion server)",
    "tpot": "(end-to-end latency - TTFT) / (output tokens - 1), per request",
    "e2el": "time from sending a request to the end of its stream",
    "committed_throughput": "committed tokens (usage.completion_tokens of requests with usage.diffusion) / duration",
}


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
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request, e.g. \'{"diffusion": {"policy": "low_confidence"}}\'')
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
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
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
    """One streamed completion, timed at every chunk that carries output."""
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
                for choice in msg.get("choices") or []:
                    # A chunk with no text that only closes the stream (finish_reason) is not output.
                    if choice.get("text") or choice.get("finish_reason") is None:
                        res.chunk_times.append(now)
                    text.append(choice.get("text") or "")
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


def request_body(args: argparse.Namespace, model: str, prompt) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.random_output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body | args.extra_body


async def run_level(client: httpx.AsyncClient, url: str, bodies: list[dict], prompts: Prompts, tokenizer,
                    concurrency: int | None, args: argparse.Namespace) -> dict:
    """One benchmark: every prompt once, at most `concurrency` in flight, arrivals at --request-rate."""
    gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    rng = np.random.default_rng(args.seed)
    bar = tqdm(total=len(bodies), desc=f"concurrency {concurrency or 'none'}", disable=args.disable_tqdm,
               file=sys.stderr)

    async def one(body: dict, prompt_len: int) -> RequestResult:
        async with gate:
            res = await send(client, url, body, prompt_len, tokenizer)
        bar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for body, n in zip(bodies, prompts.lens):
        tasks.append(asyncio.create_task(one(body, n)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return summarize(results, duration, concurrency, args.request_rate, args.metric_percentiles)


async def served_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        r = await client.get(f"{base}/v1/models")
        r.raise_for_status()
    except httpx.HTTPError as err:
        raise SystemExit(f"could not list the models at {base}/v1/models ({type(err).__name__}: {err}); "
                         "is the server up? --model skips this") from None
    return r.json()["data"][0]["id"]


# ----------------------------------------------------------------------------------------------- main


def make_prompts(args: argparse.Namespace, tokenizer) -> Prompts:
    rng = np.random.default_rng(args.seed)
    if tokenizer is not None:
        return text_prompts(tokenizer, args.num_prompts, args.random_input_len, rng)
    return token_id_prompts(args.num_prompts, args.random_input_len, args.random_vocab_size, rng)


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
        prompts = make_prompts(args, tokenizer)
        bodies = [request_body(args, model, p) for p in prompts.prompts]
        print(f"Model: {model}\nPrompts: {args.num_prompts} x {prompts.source}\n"
              f"Output: max_tokens={args.random_output_len}{', ignore_eos' if args.ignore_eos else ''}\n"
              "ITL is per streamed chunk (on a diffusion server, one committed block); TPOT is per token.")
        check = await send(client, url, bodies[0], prompts.lens[0], tokenizer)  # fail fast; warms the server up
        if not check.ok:
            raise SystemExit(f"the test request to {url} failed: {check.error}")
        print(f"Test request: ok, {check.output_tokens} tokens in {check.latency:.2f} s")
        summaries = []
        for concurrency in args.max_concurrency:
            print(f"\nTraffic request rate: {args.request_rate}\nMaximum request concurrency: {concurrency}",
                  flush=True)
            summary = await run_level(client, url, bodies, prompts, tokenizer, concurrency, args)
            print(format_report(summary, args.metric_percentiles, args.percentile_metrics), flush=True)
            summaries.append(summary)
    if len(summaries) > 1:
        print("\n" + format_sweep(summaries, args.metric_percentiles[-1]))
    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "base_url": base,
            "endpoint": args.endpoint, "model": model, "prompts": prompts.source,
            "tokenizer": None if tokenizer is None else tokenizer.name_or_path, "definitions": DEFINITIONS,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "runs": summaries}


def _finite(obj):
    """JSON has no Infinity: an infinite request rate is written as the string "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    if args.save_result is not None:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(_finite(result), indent=1, allow_nan=False))
        print(f"Results: {args.save_result}")
    if args.plot is not None:
        from benchmarks.bench_plot import plot_sweep

        plot_sweep(result, args.plot)
        print(f"Plot: {args.plot}")
    return result


if __name__ == "__main__":
    main()
