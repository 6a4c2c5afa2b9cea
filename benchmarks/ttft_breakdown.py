"""Where a cached turn's time to first token goes, in one process (no HTTP, no Serve, no Ray).

    python -m benchmarks.ttft_breakdown --model DIR [--prefix-tokens 4096] [--suffix-tokens 29] [KEY=VALUE ...]

cache_bench measures a lone chat's TTFT through HTTP; this splits the same request's path on the engine
(the scheduler, the shard's command, and in it the prefill and the steps), so that the served figure minus
this one is what HTTP, Serve and the coordinator's Ray calls cost. Requests are greedy, AR mode (their
first token is their prefill's prediction, so the command that ends their prompt is its prefill alone and
the steps part stays 0), `--first-tokens` tokens long. Measured, of `--turns` requests each, the one whose
first token is the median (the cached ones first, while their prefix is the pool's most recently used;
every turn of a case must find its case's cached tokens, else the run fails):

  cold      a fresh prompt of prefix + suffix tokens (prefilled in chunks of the server's prefill chunk);
  cached    the same prefix with a new suffix: its cached pages are not prefilled again;
  short     a fresh prompt of the suffix's length alone: a prefill from position 0, to set beside the cached
            prompt's prefill of as many tokens past its prefix (both CUDA graphs where the runner has them).

The parts are timed with the device synchronized at their starts and ends (so they add up; the served
path overlaps the host's work with the device's where it can). KEY=VALUE: Engine arguments (load_format=dummy,
max_model_len=8192, num_slots=8, dtype=bfloat16, device=cuda, ...). A result file is written (tool
`ttft_breakdown`); docs/benchmarking.md says how to read it. `--profile FILE` writes one more cached
turn's ops under torch's profiler, by host and by device time.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from benchmarks import results
from benchmarks.timed import Timed

DEFAULTS = {"device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "num_slots": 8, "max_model_len": 8192}


def engine_args(items: list[str]) -> dict:
    """DEFAULTS with the KEY=VALUE items over them, each validated against the Engine's own annotation."""
    import typing

    import pydantic

    from workers.engine import Engine

    hints = {k: v for k, v in typing.get_type_hints(Engine.__init__).items() if k not in ("return", "model_dir")}
    out = dict(DEFAULTS)
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in hints:
            raise SystemExit(f"{item!r}: expected KEY=VALUE, KEY an Engine argument: {', '.join(sorted(hints))}")
        try:
            out[key] = pydantic.TypeAdapter(hints[key]).validate_python(value)
        except pydantic.ValidationError as err:
            raise SystemExit(f"{item!r}: {err.errors()[0]['msg']}") from None
    return out


class Breakdown:
    """An engine whose scheduler, command, prefill and steps are timed."""

    def __init__(self, model: Path, engine_args: dict):
        from workers.engine import Engine

        self.engine = Engine(str(model), **engine_args)
        runner = self.engine.shards.runner
        runner.warm_up()
        cuda = str(engine_args.get("device", "")).startswith("cuda")
        sync = torch.cuda.synchronize if cuda else None
        self.parts = {"schedule": Timed(self.engine.scheduler.schedule),
                      "command": Timed(runner.execute, sync),
                      "prefill": Timed(runner._prefill, sync),
                      "steps": Timed(runner._run, sync),
                      "apply": Timed(self.engine.scheduler.apply)}
        self.engine.scheduler.schedule, runner.execute = self.parts["schedule"], self.parts["command"]
        runner._prefill, runner._run = self.parts["prefill"], self.parts["steps"]
        self.engine.scheduler.apply = self.parts["apply"]

    def first_token(self, prompt: list[int], params) -> dict[str, float]:
        """Milliseconds from the request's arrival to its first token, and each part's share of them;
        then the request runs to its end (untimed)."""
        for part in self.parts.values():
            part.take()
        start = time.perf_counter()
        request = self.engine.add(prompt, params)
        commands = 0
        while not request.output and not request.finished:
            self.engine.step()
            commands += 1
        total = time.perf_counter() - start
        row = {name: 1e3 * part.take() for name, part in self.parts.items()}
        row["ttft"], row["commands"], row["cached_tokens"] = 1e3 * total, commands, request.cached_tokens
        self.engine.run([request])
        return row

    def close(self) -> None:
        self.engine.shards.close()


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The row of the median first token (the lower middle of an even count): its parts add up."""
    return sorted(rows, key=lambda r: r["ttft"])[(len(rows) - 1) // 2]


def uniform(rows: list[dict[str, float]], case: str, cached_tokens: int) -> list[dict[str, float]]:
    """The rows, each of which found `cached_tokens` cached (a case that did not is not that case)."""
    found = sorted({r["cached_tokens"] for r in rows})
    if found != [cached_tokens]:
        raise RuntimeError(f"{case}: cached tokens {found}, expected {cached_tokens} in every turn")
    return rows


def profiled(bench: Breakdown, prompt: list[int], params, out: Path) -> None:
    """One more first token under torch's profiler: its ops by self host time and by device time, to `out`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        bench.first_token(prompt, params)
    table = prof.key_averages()
    sections = [("self host time", "self_cpu_time_total")]
    if len(activities) > 1:
        sections.append(("self device time", "self_device_time_total"))
    out.write_text("".join(f"== by {what}\n{table.table(sort_by=key, row_limit=40)}\n" for what, key in sections))


def measure(model: Path, engine_args: dict, prefix_tokens: int, suffix_tokens: int, turns: int, first_tokens: int,
            seed: int = 0, profile: Path | None = None) -> dict[str, dict[str, float]]:
    """The median row of each case; with `profile`, one more cached turn's profile is written there."""
    from model.protocol import PAGE_SIZE
    from model.sampling.params import DecodeParams

    if engine_args.get("tp", 1) != 1:
        raise ValueError("ttft_breakdown times the shard in this process: tp=1 only")
    params = DecodeParams(temperature=0, max_tokens=first_tokens, ignore_eos=True, mode="ar")
    bench = Breakdown(model, engine_args)
    rng, vocab = random.Random(seed), min(bench.engine.config.vocab_size, 1000)
    words = lambda n: [rng.randrange(10, vocab) for _ in range(n)]   # noqa: E731
    try:
        # untimed first calls of each path: a cold prompt, then the prefix cached and a first turn past it;
        # the cached turns run first, while the prefix's pages are the most recently used
        bench.first_token(words(prefix_tokens + suffix_tokens), params)
        prefix = words(prefix_tokens)
        bench.first_token(prefix + words(suffix_tokens), params)
        bench.first_token(prefix + words(suffix_tokens), params)
        cached = uniform([bench.first_token(prefix + words(suffix_tokens), params) for _ in range(turns)], "cached",
                         prefix_tokens // PAGE_SIZE * PAGE_SIZE)
        cold = uniform([bench.first_token(words(prefix_tokens + suffix_tokens), params) for _ in range(turns)],
                       "cold", 0)
        short = uniform([bench.first_token(words(suffix_tokens), params) for _ in range(turns)], "short", 0)
        measured = {"cold": median_row(cold), "cached": median_row(cached), "short": median_row(short)}
        if profile is not None:
            profiled(bench, prefix + words(suffix_tokens), params, profile)
        return measured
    finally:
        bench.close()


def figures(measured: dict[str, dict[str, float]]) -> dict[str, float]:
    out = {f"ttft.{case}.{part}" + ("" if part in ("commands", "cached_tokens") else "_ms"): value
           for case, row in measured.items() for part, value in row.items()}
    out["ttft.cached_over_cold"] = measured["cached"]["ttft"] / measured["cold"]["ttft"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=29, help="a turn's new tokens (cache_bench's are about this)")
    ap.add_argument("--first-tokens", type=int, default=2, help="max_tokens of each request")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--results-dir", type=results.directory, default=results.DEFAULT_DIR,
                    help="where the result file goes ($OUT where set); '' writes none")
    ap.add_argument("--profile", type=Path, help="also profile one cached turn (torch.profiler) into this file")
    ap.add_argument("engine_args", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    engine = engine_args(args.engine_args)
    measured = measure(args.model, engine, args.prefix_tokens, args.suffix_tokens, args.turns, args.first_tokens,
                       profile=args.profile)
    parts = ("ttft", "schedule", "command", "prefill", "steps", "apply")
    print(f"{'ms, median of ' + str(args.turns):<22}" + "".join(f"{p:>10}" for p in parts) + f"{'commands':>10}")
    for case, row in measured.items():
        print(f"{case:<22}" + "".join(f"{row[p]:>10.2f}" for p in parts) + f"{row['commands']:>10.0f}")
    out = figures(measured)
    print(f"cached / cold TTFT: {out['ttft.cached_over_cold']:.3f} ({out['ttft.cached.cached_tokens']:.0f} tokens cached)")
    if args.results_dir is not None:
        results.write(out, "ttft_breakdown", results_dir=args.results_dir,
                      note=f"model {args.model.name}; {args.prefix_tokens}-token prefix + {args.suffix_tokens}-token "
                           f"suffix, AR, {args.first_tokens} tokens; {engine}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
