"""Served denoising-step rate against the bare runner's, in one run, on one GPU.

    python benchmarks/step_rate.py [--canvases 8] [--out result.json]

A Nemotron-Labs-Diffusion-8B-shaped model with dummy weights (bf16), batch 1, canvas 32, a fixed
schedule (low_confidence, 32 denoising steps per canvas). Three measurements of the same request:
  bare    the Runner driven directly in this process (no scheduler, no Ray);
  engine  the in-process engine (scheduler + runner);
  served  the Serve app (HTTP ingress -> Coordinator -> ShardWorker actor), timed at the client.
The rate is denoising steps per second of wall time (prefill and commits included in all three). Also
reports the weight-read floor: one forward reads every weight once, so a step takes at least
weight bytes / memory bandwidth.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import write_shapes  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.protocol import Command, NewSlot  # noqa: E402
from model.runner import Runner  # noqa: E402
from model.sampling.params import DecodeParams  # noqa: E402

BANDWIDTH = 4.3e12  # bytes/s, measured device-to-device copy on the H200 (DESIGN/device notes)


def fixed_schedule(canvases: int) -> DecodeParams:
    return DecodeParams(temperature=0, max_tokens=32 * canvases, ignore_eos=True, policy="low_confidence",
                        max_denoising_steps=32, seed_first_position=False)


def time_bare(model_dir: Path, params: DecodeParams, prompt: list[int]) -> dict:
    model = load_model(model_dir, dtype="bfloat16", device="cuda", load_format="dummy")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = Runner(model, num_slots=1, max_model_len=len(prompt) + params.max_tokens + 64, device="cuda")

    def run() -> tuple[int, float]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        cmd, steps, emitted = Command(admit=(NewSlot(0, tuple(prompt), params, 0),), max_steps=10_000), 0, 0
        while emitted < params.max_tokens:
            events = runner.execute(cmd)
            steps += events.counters.denoising_steps
            emitted += sum(len(b.tokens) for b in events.blocks)
            cmd = Command(max_steps=10_000)
        torch.cuda.synchronize()
        runner.execute(Command(release=(0,), max_steps=0))
        return steps, time.perf_counter() - t

    run()  # warm-up
    steps, wall = run()
    # forward-only time of one denoise step, for the roofline figure
    torch.cuda.synchronize()
    del runner, model
    torch.cuda.empty_cache()
    return {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "weight_bytes": weight_bytes}


def time_engine(model_dir: Path, params: DecodeParams, prompt: list[int]) -> dict:
    from workers.engine import Engine

    with Engine(model_dir, num_slots=1, max_model_len=len(prompt) + params.max_tokens + 64, device="cuda",
                dtype="bfloat16", load_format="dummy", max_steps_per_command=64) as engine:
        engine.generate([prompt], params)  # warm-up
        before = engine.scheduler.counters.denoising_steps
        t = time.perf_counter()
        engine.generate([prompt], params)
        wall = time.perf_counter() - t
        steps = engine.scheduler.counters.denoising_steps - before
    torch.cuda.empty_cache()
    return {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall}


def time_served(model_dir: Path, params: DecodeParams, prompt: list[int]) -> dict:
    import openai
    from ray import serve

    from deployments.app import build_app
    from tests.serve_harness import start_serve, stop_serve

    port = start_serve()
    try:
        serve.run(build_app({"model": str(model_dir), "served_model_name": "bench", "device": "cuda",
                             "dtype": "bfloat16", "load_format": "dummy", "max_num_seqs": 1,
                             "max_model_len": len(prompt) + params.max_tokens + 64,
                             "max_steps_per_command": 64}), name="bench", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        body = dict(model="bench", prompt=prompt, max_tokens=params.max_tokens, temperature=0,
                    extra_body={"ignore_eos": True, "diffusion": {
                        "policy": "low_confidence", "max_denoising_steps": 32, "seed_first_position": False}})
        client.completions.create(**body)  # warm-up (and shard start)
        t = time.perf_counter()
        r = client.completions.create(**body)
        wall = time.perf_counter() - t
        steps = r.usage.model_extra["diffusion"]["denoising_steps"]
    finally:
        stop_serve()
    return {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canvases", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/nemotron-ld-8b-shapes"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = write_shapes(args.model_dir)
    params = fixed_schedule(args.canvases)
    prompt = [1] + list(range(1000, 1015))
    result = {"device": torch.cuda.get_device_name(), "canvases": args.canvases, "batch": 1, "canvas": 32}
    result["bare"] = time_bare(model_dir, params, prompt)
    result["engine"] = time_engine(model_dir, params, prompt)
    result["served"] = time_served(model_dir, params, prompt)
    floor_s = result["bare"]["weight_bytes"] / BANDWIDTH
    result["weight_read_floor_steps_per_s"] = 1 / floor_s
    result["bare_vs_floor"] = result["bare"]["steps_per_s"] * floor_s
    result["served_vs_bare"] = result["served"]["steps_per_s"] / result["bare"]["steps_per_s"]
    result["engine_vs_bare"] = result["engine"]["steps_per_s"] / result["bare"]["steps_per_s"]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
