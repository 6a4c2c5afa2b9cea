"""The prefix cache's lookup against the scheduler's host time.

    python -m benchmarks.prefix_lookup_bench [--cached-pages 10000] [--prompt-len 4096] [--requests 64]

SGLang found its radix match taking most of its scheduler's CPU on diverse 4k-token prompts (its issue
#33322). Here a Scheduler over a KV pool already caching `--cached-pages` pages (written by earlier
diverse prompts) admits diverse prompts of `--prompt-len` tokens (a common system prefix of a quarter of
them, the rest each its own) into 8 slots, a command at a time, until each is prefilled (in chunks).
Reported: a prompt's page addresses, hashed once as it comes (`Scheduler.add`); the lookups' time (the
longest cached run of those addresses) against the time of every `Scheduler.schedule` call that made those
commands, lookups included. The scheduler's is only part of a command's host time (the coordinator also
reads events and streams answers), so the share of the whole is smaller than the one reported.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks import results
from benchmarks.timed import Timed
from model.sampling.params import DecodeParams
from workers import kv_pages
from workers.kv_pages import KVPages, PageGroup
from workers.scheduler import Scheduler

PAGE = 16


def fill(pages: KVPages, cached_pages: int, prompt_len: int, rng: random.Random) -> None:
    """Caches `cached_pages` pages: diverse prompts admitted, their KV written, then let go."""
    n = 0
    while pages.pools[0].cached < cached_pages:
        prompt = [rng.randrange(10, 100_000) for _ in range(prompt_len)]
        rid = f"fill-{n}"
        pages.admit(rid, prompt, prompt_len, prompt_len)
        pages.extend(rid, prompt_len, 0)
        pages.register(rid, prompt, written=prompt_len)
        pages.free(rid)
        n += 1


def measure(cached_pages: int, prompt_len: int, requests: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    pool = cached_pages + 8 * (prompt_len // PAGE + 64) + 1024
    pages = KVPages([PageGroup(pool)], PAGE, b"bench")
    fill(pages, cached_pages, prompt_len, rng)
    system = [rng.randrange(10, 100_000) for _ in range(prompt_len // 4)]
    lookup, hashes = Timed(pages._lookup), Timed(kv_pages.page_hashes)
    pages._lookup, kv_pages.page_hashes = lookup, hashes
    schedule_s, add_s, commands, admitted, hits = 0.0, 0.0, 0, 0, pages.hits
    try:
        params = DecodeParams(max_tokens=64, ignore_eos=True)
        done = 0
        while done < requests:
            scheduler = Scheduler(8, 64, [0], prompt_len + 256, 32, 8, pages=pages)
            prompts = [system + [rng.randrange(10, 100_000) for _ in range(prompt_len - len(system))]
                       for _ in range(min(8, requests - done))]
            start = time.perf_counter()
            batch = [scheduler.add(f"r{done + i}", p, params) for i, p in enumerate(prompts)]
            add_s += time.perf_counter() - start
            while any(r.slot is None or r.prefilled < len(r.prompt) for r in batch):
                start = time.perf_counter()
                command = scheduler.schedule()
                schedule_s += time.perf_counter() - start
                commands += 1
                scheduler._in_flight.clear()   # no shards: every command is done at once
                assert command is not None
            admitted += len(batch)
            done += len(batch)
            for r in batch:
                pages.free(r.request_id)
    finally:
        kv_pages.page_hashes = hashes.fn
        del pages._lookup
    # a prompt's addresses are hashed once, as it comes (its later pages' as they are committed); admission
    # looks them up
    return {"cached_pages": float(pages.pools[0].cached), "prompt_tokens": float(prompt_len),
            "requests": float(admitted), "commands": float(commands),
            "address_us_per_request": 1e6 * hashes.seconds / admitted,
            "add_us_per_request": 1e6 * add_s / admitted,
            "lookup_us_per_request": 1e6 * lookup.seconds / admitted,
            "schedule_us_per_command": 1e6 * schedule_s / commands,
            "lookup_share_of_schedule": lookup.seconds / schedule_s,
            "hit_tokens_per_request": (pages.hits - hits) / admitted}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_lookup_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cached-pages", type=int, default=10_000)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--save-result", action="store_true", help="write a result file (benchmarks/results.py)")
    p.add_argument("--results-dir", type=Path, default=results.DEFAULT_DIR)
    args = p.parse_args(argv)
    figures = measure(args.cached_pages, args.prompt_len, args.requests)
    for name, value in figures.items():
        print(f"{name:28s} {value:12.3f}")
    if args.save_result:
        results.write(figures, "prefix_lookup_bench", results_dir=args.results_dir)
    return figures


if __name__ == "__main__":
    main()
