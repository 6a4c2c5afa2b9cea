"""How many requests fit at once in the same KV memory: the paged pool against a slot each.

    python -m benchmarks.kv_capacity [--prompt-len 1024] [--max-tokens 128] [--max-model-lens 2048,8192,32768]

Before the paged cache, every slot held `max_model_len` + a canvas positions in every layer, so
`max_num_seqs` (8 here) requests ran at once whatever their lengths. Here that same memory, per family's
full-size shape (its KV layout counted from the model built as fake tensors, bf16), is split into pages
as the server splits GPU memory (model/kv_budget.py: a sliding group at most what its slots hold at once,
the full group the rest), and the scheduler's own admission (workers/kv_pages.py) takes requests of
`--prompt-len` prompt tokens and `--max-tokens` until one has to wait. No GPU, no model run.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from benchmarks import results
from benchmarks.shapes import fake_model
from model.kv_budget import ahead_positions, pool_pages, sliding_pages
from model.protocol import PAGE_SIZE, PREFILL_CHUNK
from model.sampling.params import DecodeParams
from workers.kv_pages import KVPages, PageGroup
from workers.scheduler import Scheduler

SLOTS = 8            # max_num_seqs before: one request a slot
BATCH_CAP = 1024     # max_num_seqs now: only a batch cap, above what memory holds here
MAX_STEPS = 8        # max_steps_per_command (the served default)


def kv_layout(family: str):
    """The full-size shape's KV layout, canvas length and EOS ids (benchmarks/shapes.py: fake_model)."""
    cfg, net = fake_model(family)
    return net.kv_layout, cfg.canvas_length, list(cfg.eos_token_ids)


def fits(family: str, max_model_len: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    layout, C, eos = kv_layout(family)
    page_bytes, windows = layout.page_bytes(torch.bfloat16, PAGE_SIZE), layout.group_windows
    memory = sum(page_bytes) * (SLOTS * -(-(max_model_len + C) // PAGE_SIZE) + 1)   # the slots' cache (+ a sink)
    ahead = ahead_positions(max_model_len, PREFILL_CHUNK, MAX_STEPS, C)
    cap = BATCH_CAP * max((sliding_pages(w, ahead, PAGE_SIZE) for w in windows if w), default=0)
    pages = pool_pages(memory, page_bytes, windows, cap)
    pool = KVPages([PageGroup(n, w) for n, w in zip(pages, windows)], PAGE_SIZE, b"capacity")
    scheduler = Scheduler(BATCH_CAP, 0, eos, max_model_len, C, MAX_STEPS, pages=pool)
    params, rng, admitted = DecodeParams(max_tokens=max_tokens, ignore_eos=True), random.Random(0), 0
    while admitted < BATCH_CAP:
        prompt = [rng.randrange(10, 100_000) for _ in range(prompt_len)]   # no shared prefix
        if pool.admit(f"r{admitted}", prompt, scheduler._kv_positions(prompt_len, params),
                      scheduler._ahead(prompt_len, params)) is None:
            break
        admitted += 1
    key = f"kv_capacity.{family}.{max_model_len}"
    return {f"{key}.slots": float(SLOTS), f"{key}.paged": float(admitted), f"{key}.ratio": admitted / SLOTS,
            f"{key}.full_pages": float(pages[0])}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-lens", default="2048,8192,32768")
    p.add_argument("--families", default="nemotron-ld,diffusion-gemma")
    p.add_argument("--save-result", action="store_true", help="write a result file (benchmarks/results.py)")
    p.add_argument("--results-dir", type=Path, default=results.DEFAULT_DIR)
    args = p.parse_args(argv)
    figures: dict[str, float] = {}
    for family in args.families.split(","):
        for length in (int(x) for x in args.max_model_lens.split(",")):
            figures |= fits(family, length, args.prompt_len, args.max_tokens)
    for name, value in figures.items():
        print(f"{name:48s} {value:10.2f}")
    if args.save_result:
        results.write(figures, "kv_capacity", card="CPU (no model run)", results_dir=args.results_dir)
    return figures


if __name__ == "__main__":
    main()
