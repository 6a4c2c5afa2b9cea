"""What one benchmark run measured, and the report `serve_bench` prints (the sections of `vllm bench serve`).

All times from the client's clock, per request: TTFT to the first streamed chunk that carries output
(also when its text is "", as vLLM's benchmark counts); ITL the gap between such chunks, which on a
diffusion server is one committed canvas, not one token; TPOT (end-to-end - TTFT) / (output tokens - 1);
E2EL to the end of the stream. The Diffusion Decoding block sums each request's `usage.diffusion`
(docs/spec.md section 8); committed throughput = committed tokens / benchmark duration.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# metric key -> (section title, label stem)
LATENCY_METRICS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
WIDTH = 50  # vLLM's report width: 40-character labels, then the value


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds since the request was sent."""

    ok: bool = False
    error: str = ""
    input_tokens: int = 0               # the server's usage.prompt_tokens, else what we meant to send
    output_tokens: int | None = None    # usage.completion_tokens, else our tokenizer's count, else None
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk with choices
    latency: float = 0.0                # end of the stream
    usage: dict | None = None           # the final usage object, if the server sent one

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return chunk_gaps(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if self.ttft is None or n is None or n < 2:
            return None
        return (self.latency - self.ttft) / (n - 1)


def chunk_gaps(times: list[float]) -> list[float]:
    """[t0, t1, t2] -> [t1 - t0, t2 - t1]: the inter-token latencies of one streamed request."""
    return [b - a for a, b in zip(times, times[1:])]


def _spread(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std / pN of seconds, reported in milliseconds (0 when there are no values)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            **{f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles}}


def diffusion_totals(results: list[RequestResult], duration: float) -> dict | None:
    """Sums of `usage.diffusion` over the requests that reported it; None when none did."""
    rows = [(r.usage["completion_tokens"], r.usage["diffusion"]) for r in results
            if r.ok and r.usage and r.usage.get("diffusion")]
    if not rows:
        return None
    committed = sum(n for n, _ in rows)
    steps = sum(d["denoising_steps"] for _, d in rows)
    canvases = sum(d["canvases"] for _, d in rows)
    # Servers older than canvas_positions in usage do not report it: None, not a wrong 0.
    positions = None if any("canvas_positions" not in d for _, d in rows) else \
        sum(d["canvas_positions"] for _, d in rows)
    return {"requests": len(rows), "committed_tokens": committed, "denoising_steps": steps, "canvases": canvases,
            "canvas_positions": positions,
            "committed_throughput": committed / duration if duration > 0 else 0.0,
            "steps_per_canvas": steps / canvases if canvases else None,
            "committed_per_step": committed / steps if steps else None}


def summarize(results: list[RequestResult], duration: float, max_concurrency: int | None,
              request_rate: float, percentiles: list[float]) -> dict:
    """Every figure of one run (one concurrency level), flat like vLLM's saved JSON, plus per-request lists."""
    done = [r for r in results if r.ok]
    inputs = sum(r.input_tokens for r in done)
    outputs = sum(r.output_tokens or 0 for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]  # requests of one token have none
    itls = [gap for r in done for gap in r.itl]
    out = {"max_concurrency": max_concurrency, "request_rate": request_rate, "completed": len(done),
           "failed": len(results) - len(done), "duration": duration, "total_input_tokens": inputs,
           "total_output_tokens": outputs, "usage_reported": all(r.usage for r in done),
           "request_throughput": len(done) / duration if duration > 0 else 0.0,
           "output_throughput": outputs / duration if duration > 0 else 0.0,
           "total_token_throughput": (inputs + outputs) / duration if duration > 0 else 0.0}
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", [r.latency for r in done])):
        out |= {f"{stat}_{key}_ms": v for stat, v in _spread(values, percentiles).items()}
    out["diffusion"] = diffusion_totals(results, duration)
    out |= {"input_lens": [r.input_tokens for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "e2els": [r.latency if r.ok else None for r in results], "errors": [r.error for r in results]}
    return out


# ------------------------------------------------------------------------------------------ report


def _rule(title: str, fill: str) -> str:
    return title.center(WIDTH, fill)


def _line(label: str, value, fmt: str = ".2f") -> str:
    text = "n/a" if value is None else format(value, fmt) if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def format_report(s: dict, percentiles: list[float], metrics: list[str]) -> str:
    """The report of one run: vLLM's Serving Benchmark Result sections, then our Diffusion Decoding block."""
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Successful requests:", s["completed"]),
             _line("Failed requests:", s["failed"]),
             _line("Maximum request concurrency:", s["max_concurrency"]),
             _line("Benchmark duration (s):", s["duration"]),
             _line("Total input tokens:", s["total_input_tokens"]),
             _line("Total generated tokens:", s["total_output_tokens"]),
             _line("Request throughput (req/s):", s["request_throughput"]),
             _line("Output token throughput (tok/s):", s["output_throughput"]),
             _line("Total Token throughput (tok/s):", s["total_token_throughput"])]
    for key in metrics:
        title, stem = LATENCY_METRICS[key]
        lines.append(_rule(title, "-"))
        lines.append(_line(f"Mean {stem} (ms):", s[f"mean_{key}_ms"]))
        lines.append(_line(f"Median {stem} (ms):", s[f"median_{key}_ms"]))
        lines += [_line(f"P{p:g} {stem} (ms):", s[f"p{p:g}_{key}_ms"]) for p in percentiles]
    d = s["diffusion"]
    if d is not None:
        lines += [_rule("Diffusion Decoding", "-"),
                  _line("Committed throughput (tok/s):", d["committed_throughput"]),
                  _line("Denoising steps per canvas:", d["steps_per_canvas"]),
                  _line("Committed per denoising step:", d["committed_per_step"]),
                  _line("Committed tokens:", d["committed_tokens"]),
                  _line("Denoising steps:", d["denoising_steps"]),
                  _line("Canvases:", d["canvases"]),
                  _line("Canvas positions evaluated:", d["canvas_positions"])]
    lines.append(_rule("", "="))
    return "\n".join(lines)


def format_sweep(summaries: list[dict], percentile: float) -> str:
    """One row per concurrency level: the figures the plot shows, for a terminal."""
    p = f"P{percentile:g}"
    head = (f"{'concurrency':>11} {'req/s':>7} {'out tok/s':>10} {'TTFT mean':>10} {'TTFT ' + p:>9} "
            f"{'ITL mean':>9} {'ITL ' + p:>9} {'tok/step':>9}")
    units = f"{'':>11} {'':>7} {'':>10} {'(ms)':>10} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'':>9}"
    rows = [" Concurrency Sweep ".center(len(head), "="), head, units]
    for s in summaries:
        d = s["diffusion"]
        per_step = "-" if d is None or d["committed_per_step"] is None else f"{d['committed_per_step']:.2f}"
        c = "none" if s["max_concurrency"] is None else str(s["max_concurrency"])
        rows.append(f"{c:>11} {s['request_throughput']:>7.2f} {s['output_throughput']:>10.1f} "
                    f"{s['mean_ttft_ms']:>10.1f} {s[f'p{percentile:g}_ttft_ms']:>9.1f} "
                    f"{s['mean_itl_ms']:>9.1f} {s[f'p{percentile:g}_itl_ms']:>9.1f} {per_step:>9}")
    rows.append("=" * len(head))
    return "\n".join(rows)
