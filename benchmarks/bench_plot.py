"""The PNG of a `serve_bench` sweep: throughput, inter-token latency and TTFT against concurrency."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patheffects import withStroke  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

BLUE, ORANGE, GREEN, GREY = "#1f5fbf", "#e07b00", "#2a9d5c", "#6b6b6b"


def _style(ax, title: str, ylabel: str, xs: list[float], xlabels: list[str]) -> None:
    ax.set_title(title, loc="left", fontsize=11.5, fontweight="bold", pad=10)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels(xlabels)
    lo, hi = min(xs), max(xs)
    ax.set_xlim(lo / 1.6, hi * 1.6)  # room for the labels of the end points
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _label(ax, x: float, y: float, text: str, color: str, below: bool = False) -> None:
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, -14 if below else 8), ha="center",
                fontsize=8.5, color=color, fontweight="normal" if below else "bold",
                path_effects=[withStroke(linewidth=3, foreground="white")])  # legible over the lines


def _latency_panel(ax, runs: list[dict], xs: list[float], key: str, pct: str, color: str) -> None:
    mean = [r[f"mean_{key}_ms"] for r in runs]
    tail = [r[f"{pct}_{key}_ms"] for r in runs]
    ax.fill_between(xs, mean, tail, color=color, alpha=0.10, linewidth=0)
    ax.plot(xs, mean, "-", color=color, linewidth=2.2, marker="o", markersize=6, label="mean")
    ax.plot(xs, tail, "--", color=color, alpha=0.75, linewidth=1.6, marker="o", markersize=4.5,
            label=pct.upper())
    for x, m, t in zip(xs, mean, tail):
        _label(ax, x, t, f"{t:,.0f}", color)
        _label(ax, x, m, f"{m:,.0f}", color, below=True)
    ax.set_ylim(0, max(tail) * 1.22 if max(tail) > 0 else 1)
    ax.legend(frameon=False, fontsize=9, loc="upper left")


def plot_sweep(result: dict, path: Path) -> None:
    """`result` is what serve_bench.main returns (and saves as JSON); writes a PNG to `path`."""
    runs = result["runs"]
    args = result["args"]
    n = args["num_prompts"]
    xs = [r["max_concurrency"] or n for r in runs]  # no limit: every prompt in flight at once
    xlabels = [str(r["max_concurrency"]) if r["max_concurrency"] else f"none ({n})" for r in runs]
    pct = f"p{args['metric_percentiles'][-1]:g}"

    height = 5.4  # inches; the header above the panels takes a fixed HEADER of them
    fig, axes = plt.subplots(1, 3, figsize=(14, height), dpi=100)
    ax = axes[0]
    tput = [r["output_throughput"] for r in runs]
    ax.plot(xs, tput, "-", color=BLUE, linewidth=2.4, marker="o", markersize=7)
    for x, y in zip(xs, tput):
        _label(ax, x, y, f"{y:,.0f}", BLUE)
    _style(ax, "Output token throughput", "tokens / s", xs, xlabels)
    ax.set_ylim(0, max(tput) * 1.2 if max(tput) > 0 else 1)

    _latency_panel(axes[1], runs, xs, "itl", pct, ORANGE)
    _style(axes[1], "Inter-token latency (per streamed block)", "ms", xs, xlabels)
    _latency_panel(axes[2], runs, xs, "ttft", pct, GREEN)
    _style(axes[2], "Time to first token", "ms", xs, xlabels)

    date = datetime.fromisoformat(result["date"]).strftime("%Y-%m-%d %H:%M")
    inch = 1 / height  # figure fraction per inch, to place the header in inches from the top
    fig.text(0.012, 1 - 0.2 * inch, f"Serving benchmark  ·  {result['model']}", ha="left", va="top", fontsize=15,
             fontweight="bold")
    eos = ", ignore_eos" if args["ignore_eos"] else ""
    # results saved before "lengths" existed had one length for every request
    lengths = result.get("lengths") or f"{args['random_input_len']} input / {args['random_output_len']} output tokens"
    mix = f" (mix {args['mix']})" if args.get("mix") else ""
    lines = [f"{n} prompts per level  ·  {lengths}{eos}{mix}  ·  {_arrivals(args['request_rate'])}  ·  "
             f"{result['base_url']}  ·  {date}"]
    diffusion = _diffusion_line(runs)
    if diffusion:
        lines.append(diffusion)
    fig.text(0.012, 1 - 0.55 * inch, "\n".join(lines), ha="left", va="top", fontsize=10, color=GREY,
             linespacing=1.6)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.65 + 0.28 * len(lines)) * inch), w_pad=2.5)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, facecolor="white")
    plt.close(fig)


def _arrivals(rate) -> str:
    rate = float(rate)  # the saved JSON writes an infinite rate as "inf"
    return "all requests sent at once" if rate == float("inf") else f"Poisson arrivals at {rate:g} req/s"


def _diffusion_line(runs: list[dict]) -> str | None:
    """The decoding figures of the sweep in one line (a range where they differ between levels)."""
    ds = [r["diffusion"] for r in runs if r["diffusion"] is not None]
    if not ds:
        return None

    def span(key: str, fmt: str) -> str:
        values = [d[key] for d in ds if d[key] is not None]
        if not values:
            return "n/a"
        lo, hi = format(min(values), fmt), format(max(values), fmt)
        return lo if lo == hi else f"{lo}-{hi}"

    return (f"diffusion decoding: {span('steps_per_canvas', '.1f')} denoising steps per canvas  ·  "
            f"{span('committed_per_step', '.2f')} committed tokens per denoising step")
