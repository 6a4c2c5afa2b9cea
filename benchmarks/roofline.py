"""The GPU roofline benchmark (`make bench`): the ratios of docs/performance.md's speed tables from ONE
run on one GPU, dummy weights.

    python3 -m benchmarks.roofline [--out result.json] [--results-dir DIR] [--skip served,transformers,...]

P1 step / weight-read floor, P2 served / bare step rate, P3 ours / transformers' generate, P4 batching,
SC self-conditioning's cost, BI batch-invariant mode's cost, FP8 both families' FP8-dynamic steps
against their floor and their BF16 twins, T speed under real traffic (benchmarks/traffic.py), P5 tensor
parallelism (two GPUs), and step profiles. docs/benchmarking.md defines each row and what --skip takes;
e.g. `--skip bf16,nemotron,traffic,tp` times DiffusionGemma's FP8 rows alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import results, tp_bench
from benchmarks.shapes import write_diffusion_gemma_shapes, write_fp8_dynamic, write_shapes
from model.checkpoint import RunnerArgs
from model.parallel.group import TPGroup
from model.parallel.small_allreduce import disable_multicast
from model.protocol import Command, NewSlot
from model.runner import Runner
from model.sampling.params import DecodeParams
from workers.scheduler import Scheduler

STEPS_PER_COMMAND = 32
SERVED_REPEATS = 3     # P2 takes the median request: one request's wall is at the mercy of a hiccup
STEADY_REPEATS = 5     # DiffusionGemma's P1 and SC: medians of this many requests with and without


# ---- measurements --------------------------------------------------------------------------------

def copy_bandwidth() -> float:
    """bytes/s of a device-to-device copy, counting bytes read plus written (median of 10)."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    times = []
    for _ in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * (1 << 30) * 2 / sorted(times[3:])[5]


def floor_bytes(model) -> int:
    """Bytes one forward must read: every parameter, except an untied input embedding table (only the
    rows of the step's tokens are read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        total -= model.encoder.embed_tokens.weight.numel() * model.encoder.embed_tokens.weight.element_size()
    return total


def run_requests(runner: Runner, prompts: list[list[int]], params: DecodeParams) -> dict:
    """Runs the prompts to the end as the server does: commands from its scheduler (workers/scheduler.py,
    at most STEPS_PER_COMMAND steps, fewer when the slots' step bounds say so). Times every command
    separately (synchronised), so the steady state (commands after the first, which holds the prefill)
    is reported apart from the whole."""
    n = len(prompts)
    scheduler = Scheduler(runner.slots.num_slots, n, runner.model.config.eos_token_ids, runner.max_model_len,
                          runner.C, STEPS_PER_COMMAND, budget=runner.budget)
    requests = [scheduler.add(f"r{i}", p, params) for i, p in enumerate(prompts)]
    walls, steps, denoising = [], [], 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while not all(r.finished for r in requests):
        cmd = scheduler.schedule()
        t = time.perf_counter()
        events = runner.execute(cmd)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        steps.append(events.steps)
        denoising += events.counters.denoising_steps
        scheduler.apply(events)
    wall = time.perf_counter() - start
    runner.execute(scheduler.schedule())   # frees the slots
    tokens = sum(len(r.output) for r in requests)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "denoising_steps": denoising,
            "denoising_steps_per_s": denoising / wall, "steps": sum(steps), "commands": steps,
            "command_walls_s": walls,
            # None where every step ran in the first command (it holds the prefill: not a steady step)
            "steady_step_s": sum(walls[1:]) / sum(steps[1:]) if sum(steps[1:]) else None}


def timed(runner: Runner, prompts, params) -> dict:
    # warm-up: a graph key's first run is eager and its second captures it; a prefill's comes once a request
    for _ in range(2):
        run_requests(runner, prompts, params)
    return run_requests(runner, prompts, params)


def profile_step(runner: Runner, prompt: list[int], params: DecodeParams, top: int = 30) -> dict:
    """Where one step's GPU time goes, from torch.profiler over one command of 4 steps, eager; per step.
    "kernels": the kernels (device time, each counted once; "all" is the GPU's busy time). "ops": the
    operators with their input shapes (an operator's time is its kernels'; a triton kernel launched
    from python is attributed to whatever range is open, such as a compiled chain's, so ranges can
    include other kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graphs = runner.graphs, None
    runner.execute(Command(admit=(NewSlot(0, tuple(prompt), params, 0),), max_steps=2))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        runner.execute(Command(max_steps=4))
        torch.cuda.synchronize()
    runner.execute(Command(release=(0,), max_steps=0))
    runner.graphs = graphs

    def listing(events, shapes: bool) -> list[dict]:
        events = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events)
        return [{"name": e.key[:70], **({"shapes": str(e.input_shapes)[:110]} if shapes else {}),
                 "calls": e.count // 4, "cuda_ms": e.self_device_time_total / 1e3 / 4,
                 "share": e.self_device_time_total / total} for e in events[:top]] + \
            [{"name": "all", "cuda_ms": total / 1e3 / 4}]

    # "## ..." entries are annotations of ranges (a compiled chain's call) on the GPU timeline, not kernels
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and not e.key.startswith("## ")]
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.device_type == DeviceType.CPU]
    return {"kernels": listing(kernels, False), "ops": listing(ops, True),
            "per_kernel_ms": {e.key: e.self_device_time_total / 1e3 / 4 for e in kernels}}


def profile_difference(a: dict, b: dict, top: int = 15) -> list[dict]:
    """The kernels whose time per step differs most between two profiles (a - b), and the total."""
    ka, kb = a["per_kernel_ms"], b["per_kernel_ms"]
    diff = {k: ka.get(k, 0.0) - kb.get(k, 0.0) for k in ka.keys() | kb.keys()}
    rows = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
    return [{"name": k[:70], "ms": round(v, 4)} for k, v in rows] + [{"name": "all", "ms": sum(diff.values())}]


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---- the two families ------------------------------------------------------------------------------

def nemotron(work: Path, bandwidth: float, result: dict, skip: set[str]) -> None:
    model_dir = write_shapes(work / "nemotron-ld-8b")
    canvases = 8
    params = DecodeParams(temperature=0, max_tokens=32 * canvases, ignore_eos=True, policy="low_confidence",
                          max_denoising_steps=32, seed_first_position=False)
    prompt = [1] + list(range(1000, 1015))
    runner = runner_of(model_dir, 16, 1024)
    floor_s = floor_bytes(runner.model) / bandwidth
    one = timed(runner, [prompt], params)
    many = timed(runner, [prompt[:-1] + [2000 + i] for i in range(16)], params)
    result["nemotron_8b"] = {"floor_bytes": floor_bytes(runner.model), "floor_s": floor_s, "batch1": one,
                             "batch16": many}
    result["P1_nemotron"] = one["steady_step_s"] / floor_s
    result["P4"] = many["tok_per_s"] / one["tok_per_s"]
    if "profile" not in skip:
        result["nemotron_8b"]["profile"] = profile_step(runner, prompt, params)
    del runner
    free_cuda()
    if "invariant" not in skip:
        runner = runner_of(model_dir, 16, 1024, batch_invariant=True)
        inv = {"batch1": timed(runner, [prompt], params),
               "batch16": timed(runner, [prompt[:-1] + [2000 + i] for i in range(16)], params)}
        result["nemotron_8b"]["batch_invariant"] = inv
        result["BI_nemotron"] = {n: inv[f"batch{n}"]["steady_step_s"] / base["steady_step_s"]
                                 for n, base in ((1, one), (16, many))}
        del runner
        free_cuda()
    if "served" not in skip:
        served = served_rate(model_dir, prompt, params)
        result["nemotron_8b"]["served"] = served
        result["P2"] = served["denoising_steps_per_s"] / one["denoising_steps_per_s"]


def step_cases(work: Path) -> dict:
    """family -> (model dir, slots, max_model_len, {batch: prompts}, params): the batches the FP8 rows and
    P5 (tp_bench's) time a step at."""
    gen = torch.Generator().manual_seed(0)
    prompt = [1] + list(range(1000, 1015))
    long_prompts = [[2] + torch.randint(10, 262144, (1023,), generator=gen).tolist() for _ in range(4)]
    return {"nemotron": (write_shapes(work / "nemotron-ld-8b"), 16, 1024,
                         {1: [prompt], 16: [prompt[:-1] + [2000 + i] for i in range(16)]},
                         DecodeParams(temperature=0, max_tokens=256, ignore_eos=True, policy="low_confidence",
                                      max_denoising_steps=32, seed_first_position=False)),
            "gemma": (write_diffusion_gemma_shapes(work / "diffusion-gemma-26b-a4b"), 4, 2048,
                      {1: long_prompts[:1], 4: long_prompts},
                      DecodeParams(max_tokens=768, seed=1, ignore_eos=True, max_denoising_steps=16,
                                   confidence_threshold=0.0))}


def fp8(work: Path, bandwidth: float, result: dict, skip: set[str]) -> None:
    """Both families' FP8-dynamic shapes (benchmarks/shapes.write_fp8_dynamic): P1 against the bytes an FP8
    forward reads (FP8 weights, BF16 pieces included), FP8 / BF16 step times at the BF16 rows' batches
    (DiffusionGemma at 1 and 4 canvases, the 8B at 1 and 16), both FP8 steps' profiles at batch 1."""
    out = result.setdefault("fp8", {})
    for name, (shapes, slots, max_len, batches, params) in step_cases(work).items():
        if name in skip:
            continue
        for dtype, model_dir in (("bf16", shapes), ("fp8", write_fp8_dynamic(shapes, work / f"{shapes.name}-fp8"))):
            runner = runner_of(model_dir, slots, max_len)
            row = out.setdefault(name, {}).setdefault(dtype, {"floor_bytes": floor_bytes(runner.model)})
            row["floor_s"] = row["floor_bytes"] / bandwidth
            for b, prompts in batches.items():   # warmed up once (timed), then two more
                steps = [timed(runner, prompts, params)["steady_step_s"]]
                steps += [run_requests(runner, prompts, params)["steady_step_s"] for _ in range(STEADY_REPEATS // 2)]
                row[f"batch{b}_step_s"] = statistics.median(steps)
            row["P1"] = row["batch1_step_s"] / row["floor_s"]
            if dtype == "fp8" and "profile" not in skip:   # batch 1: one canvas
                row["profile"] = profile_step(runner, batches[1][0], params.model_copy(update={"max_tokens": 256}))
            del runner
            free_cuda()
        rows = out[name]
        result[f"P1_fp8_{name}"] = rows["fp8"]["P1"]
        result[f"FP8_{name}"] = {b: rows["fp8"][f"batch{b}_step_s"] / rows["bf16"][f"batch{b}_step_s"] for b in batches}


def served_rate(model_dir: Path, prompt: list[int], params: DecodeParams, overlap: bool = True) -> dict:
    import openai
    from ray import serve

    from deployments.app import build_app
    from tests.serve_harness import start_serve, stats, stop_serve

    port = start_serve()
    try:
        serve.run(build_app({"model": str(model_dir), "served_model_name": "bench", "device": "cuda",
                             "dtype": "bfloat16", "load_format": "dummy", "max_num_seqs": 16,
                             "max_model_len": 1024, "max_steps_per_command": STEPS_PER_COMMAND,
                             "overlap_commands": overlap}),
                  name="bench", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        body = dict(model="bench", prompt=prompt, max_tokens=params.max_tokens, temperature=0,
                    extra_body={"ignore_eos": True, "diffusion": {
                        "policy": "low_confidence", "max_denoising_steps": 32, "seed_first_position": False}})
        for _ in range(2):   # warm-up (shard start; the prefill's graph is captured by the second)
            client.completions.create(**body)
        walls, busy = [], []
        for _ in range(SERVED_REPEATS):
            before = stats("bench")["shard_busy_s"]
            t = time.perf_counter()
            r = client.completions.create(**body)
            walls.append(time.perf_counter() - t)
            busy.append(stats("bench")["shard_busy_s"] - before)
        steps = r.usage.model_extra["diffusion"]["denoising_steps"]
    finally:
        stop_serve()
    median = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]
    wall = walls[median]
    return {"wall_s": wall, "walls_s": walls, "shard_busy_s": busy, "control_plane_s": wall - busy[median],
            "overlap_commands": overlap, "denoising_steps": steps, "denoising_steps_per_s": steps / wall}


def diffusion_gemma(work: Path, bandwidth: float, result: dict, skip: set[str]) -> None:
    model_dir = write_diffusion_gemma_shapes(work / "diffusion-gemma-26b-a4b")
    gen = torch.Generator().manual_seed(0)
    prompt = [2] + torch.randint(10, 262144, (1023,), generator=gen).tolist()
    fixed = dict(seed=1, ignore_eos=True, max_denoising_steps=16, confidence_threshold=0.0)
    runner = runner_of(model_dir, 1, 2048)
    floor_s = floor_bytes(runner.model) / bandwidth
    ours = {n: timed(runner, [prompt], DecodeParams(max_tokens=n, **fixed)) for n in (256, 768)}
    long = DecodeParams(max_tokens=768, **fixed)
    # P1 and SC: a 768-token request's steady state is one command of ~19 steps, at the mercy of the GPU's
    # clock in that moment; so the median of STEADY_REPEATS requests each, with and without alternating
    steady = {True: [], False: []}
    runner.canvas_step.self_conditioning = False
    run_requests(runner, [prompt], long)   # captures its graphs
    for _ in range(STEADY_REPEATS):
        for on in (True, False):
            runner.canvas_step.self_conditioning = on
            steady[on].append(run_requests(runner, [prompt], long)["steady_step_s"])
    runner.canvas_step.self_conditioning = True
    with_sc, without_sc = statistics.median(steady[True]), statistics.median(steady[False])
    result["diffusion_gemma_26b"] = {"floor_bytes": floor_bytes(runner.model), "floor_s": floor_s, "ours": ours,
                                     "steady_step_s": {"with_self_conditioning": steady[True],
                                                       "without_self_conditioning": steady[False]}}
    result["P1_diffusion_gemma"] = with_sc / floor_s
    result["SC"] = with_sc / without_sc
    if "profile" not in skip:   # both ways: what self-conditioning costs beyond its P W GEMM
        runner.canvas_step.self_conditioning = False
        without = profile_step(runner, prompt, long)
        runner.canvas_step.self_conditioning = True
        profile = profile_step(runner, prompt, long)
        result["diffusion_gemma_26b"]["profile"] = profile
        result["diffusion_gemma_26b"]["profile_without_self_conditioning"] = without
        result["diffusion_gemma_26b"]["self_conditioning_kernels_ms"] = profile_difference(profile, without)
    del runner
    free_cuda()
    if "invariant" not in skip:
        runner = runner_of(model_dir, 1, 2048, batch_invariant=True)
        run_requests(runner, [prompt], long)   # captures its graphs
        inv = [run_requests(runner, [prompt], long)["steady_step_s"] for _ in range(STEADY_REPEATS)]
        result["diffusion_gemma_26b"]["batch_invariant_steady_step_s"] = inv
        result["BI_diffusion_gemma"] = statistics.median(inv) / with_sc
        del runner
        free_cuda()
    if "transformers" not in skip:
        reference = transformers_generate(model_dir, prompt, fixed)
        result["diffusion_gemma_26b"]["transformers"] = reference
        result["P3"] = {n: ours[n]["tok_per_s"] / reference[n]["tok_per_s"] for n in (256, 768)}


def transformers_generate(model_dir: Path, prompt: list[int], fixed: dict) -> dict:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    cfg = DiffusionGemmaConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = DiffusionGemmaForBlockDiffusion._from_config(cfg, dtype=torch.bfloat16).eval()
    out = {"experts_implementation": getattr(model.config.get_text_config(), "_experts_implementation", None),
           "attn_implementation": model.config._attn_implementation}
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        for n in (256, 256, 768):   # the first 256 warms up
            torch.cuda.synchronize()
            t = time.perf_counter()
            seq = model.generate(ids, max_new_tokens=n, max_denoising_steps=fixed["max_denoising_steps"],
                                 # transformers requires a threshold > 0; mean entropy never gets this low
                                 t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=1e-30,
                                 sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), eos_token_id=None,
                                 pad_token_id=None)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            seq = getattr(seq, "sequences", seq)
            new = seq.shape[1] - len(prompt)
            out[n] = {"wall_s": wall, "tokens": new, "tok_per_s": new / wall}
    del model
    free_cuda()
    return out


def runner_of(model_dir: Path, num_slots: int, max_model_len: int, batch_invariant: bool = False,
              tp: TPGroup | None = None, device: str = "cuda") -> Runner:
    """A bare bf16 runner of the dummy full-size shape on one GPU (one rank of `tp`)."""
    return Runner.from_checkpoint(RunnerArgs.read(model_dir, num_slots=num_slots, max_model_len=max_model_len,
                                                  dtype="bfloat16", device=device, load_format="dummy",
                                                  max_steps_per_command=STEPS_PER_COMMAND,
                                                  batch_invariant=batch_invariant), tp)


# ---- P5: tensor parallelism ---------------------------------------------------------------------------

def tp_measure(tp: TPGroup, device: str, cases: dict, profile: bool) -> dict:
    """On one rank: each family's steady step time per batch (the median of 3 timed runs), and with
    `profile` a step's profile. Every rank runs the same scheduler on the same events, so in lockstep."""
    out = {}
    for family, (model_dir, slots, max_len, batches, params) in cases.items():
        runner = runner_of(model_dir, slots, max_len, tp=tp, device=device)
        out[family] = {str(b): statistics.median(timed(runner, prompts, params)["steady_step_s"] for _ in range(3))
                       for b, prompts in batches.items()}
        if profile:
            first = batches[1][0]
            out[family]["profile"] = profile_step(runner, first, params.model_copy(update={"max_tokens": 256}))
        del runner
        free_cuda()
    return out


def _tp_rank(rank: int, world: int, init_file: str, cases: dict, out_file: str) -> None:
    disable_multicast()
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        got = tp_measure(TPGroup.from_default_group(f"cuda:{rank}"), f"cuda:{rank}", cases, profile=True)
        if rank == 0:
            Path(out_file).write_text(json.dumps(got, default=str))
    finally:
        torch.distributed.destroy_process_group()


def tensor_parallel(work: Path, result: dict, skip: set[str]) -> None:
    """P5 (benchmarks/tp_bench.py): TP = 1 here, TP = 2 in two spawned ranks, one GPU each."""
    import torch.multiprocessing as mp

    reason = tp_bench.skip_reason(torch.cuda.device_count())
    if reason is not None:
        result["P5"] = {"skipped": reason}
        return
    cases = {f: c for f, c in step_cases(work).items() if f not in skip}
    p5 = result["P5"] = {}
    for family, steps in tp_measure(TPGroup(), "cuda", cases, profile=False).items():
        p5[family] = {"tp1": steps}
    init_file, out_file = work / f"tp-rendezvous-{time.monotonic_ns()}", work / "tp2.json"
    ctx = mp.spawn(_tp_rank, args=(tp_bench.TP, str(init_file), cases, str(out_file)), nprocs=tp_bench.TP,
                   join=False)
    deadline = time.monotonic() + 3600
    while not ctx.join(timeout=10):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError("the TP = 2 ranks did not finish within an hour")
    for family, got in json.loads(out_file.read_text()).items():
        profile = got.pop("profile")
        p5[family].update({f"tp{tp_bench.TP}": got, "allreduce_share": tp_bench.allreduce_share(profile),
                           "tp2_profile": profile["kernels"]})


def measure_traffic(work: Path, out: Path, family: str, extra: list[str] = (), tag: str = "") -> dict:
    """benchmarks/traffic.py's measurement of one family with its default counts (or `extra` arguments);
    a server that did not start is recorded as the error (the next family still runs)."""
    from benchmarks import traffic as measurement
    from benchmarks.server_process import ServerError

    name = f"traffic-{family}{'-' + tag if tag else ''}.json"
    opts = measurement.parse_args(["--family", family, "--work", str(work), "--out", str(out.with_name(name)),
                                   *extra])
    try:
        return measurement.measure(opts)
    except ServerError as err:
        return {"family": family, "error": str(err), "server_log": str(opts.log)}


def sections(skip: set[str]) -> tuple[list[str], list[str]]:
    """The step sections (nemotron, gemma, fp8, tp) and the traffic rows (nemotron, gemma, fp8) that run
    under --skip: a family's name skips its rows everywhere (the FP8 traffic row is DiffusionGemma's),
    "bf16" the two families' BF16 sections and traffic rows but not FP8's BF16 twins."""
    bf16 = {"nemotron", "gemma"} if "bf16" in skip else set()
    steps = [s for s in ("nemotron", "gemma", "fp8", "tp") if s not in skip | bf16]
    traffic = [] if "traffic" in skip else [
        s for s in ("nemotron", "gemma", "fp8") if s not in skip | bf16 and (s != "fp8" or "gemma" not in skip)]
    return steps, traffic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "roofline.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dllm-bench"))
    parser.add_argument("--results-dir", type=results.directory, default=results.DEFAULT_DIR,
                        help="where the result file goes (benchmarks/results.py; default: $OUT where set, else "
                             "benchmarks/results); '' writes none")
    parser.add_argument("--skip", default="", help="comma list of: served, transformers, profile, invariant, "
                                                   "traffic, fp8, tp, nemotron, gemma (a family's traffic too), "
                                                   "bf16 (the families' BF16 sections; FP8's BF16 twins still run)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_bytes_per_s"] = bandwidth
    steps, traffic = sections(skip)
    for name, fn in (("nemotron", nemotron), ("gemma", diffusion_gemma), ("fp8", fp8),
                     ("tp", lambda work, _, result, skip: tensor_parallel(work, result, skip))):
        if name in steps:
            t = time.perf_counter()
            try:
                fn(args.work, bandwidth, result, skip)
            finally:  # what was measured is kept when a later part fails
                result[f"{name}_bench_s"] = time.perf_counter() - t
                args.out.write_text(json.dumps(result, indent=2, default=str))
    for name, family in (("nemotron", "nemotron-ld"), ("gemma", "diffusion-gemma"), ("fp8", "diffusion-gemma")):
        if name in traffic:
            t = time.perf_counter()
            try:
                if name == "fp8":   # the seed workload on the FP8 checkpoint users serve, at 1 and 4
                    model_dir = write_fp8_dynamic(write_diffusion_gemma_shapes(args.work / "diffusion-gemma-26b-a4b"),
                                                  args.work / "diffusion-gemma-26b-a4b-fp8")
                    result.setdefault("traffic", {})["diffusion-gemma-fp8"] = measure_traffic(
                        args.work, args.out, family, ["--model", str(model_dir), "--seed-levels", "1,4",
                                                      "--requests", "16", "--warmup-requests", "8"], "fp8")
                    continue
                result.setdefault("traffic", {})[family] = measure_traffic(args.work, args.out, family,
                                                                           ["--warm-restart"])
            finally:
                result[f"traffic_{name}_s"] = time.perf_counter() - t
                args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    print(summary(result))
    args.out.write_text(json.dumps(result, indent=2, default=str))
    if args.results_dir is not None:
        results.write(figures(result), "roofline", card=result["device"], results_dir=args.results_dir)


MODELS = {"nemotron": "nemotron-ld-8b", "gemma": "diffusion-gemma-26b-a4b"}
BATCH = {"nemotron": "b", "gemma": "c"}   # requests of one canvas each / canvases


def figures(r: dict) -> dict[str, float | None]:
    """A result file's figures (benchmarks/results.py) under stable names: `<section>.<model>.<figure>`,
    step times in ms, a batch as b<requests> or c<canvases>; traffic's as benchmarks/traffic.py names them."""
    from benchmarks import traffic

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1e3

    out = {"copy_bandwidth_tb_s": r["copy_bandwidth_bytes_per_s"] / 1e12}
    if nl := r.get("nemotron_8b"):
        m = f"bf16.{MODELS['nemotron']}"
        for b in (1, 16):
            out[f"{m}.step_ms.b{b}"] = ms(nl[f"batch{b}"]["steady_step_s"])
            out[f"{m}.tok_s.b{b}"] = nl[f"batch{b}"]["tok_per_s"]
        out |= {f"{m}.floor_ms": ms(nl["floor_s"]), f"{m}.P1": r.get("P1_nemotron"), f"{m}.P4": r.get("P4")}
        inv, m = nl.get("batch_invariant") or {}, f"batch_invariant.{MODELS['nemotron']}"
        for b in (1, 16):
            if f"batch{b}" in inv:
                out[f"{m}.step_ms.b{b}"] = ms(inv[f"batch{b}"]["steady_step_s"])
                out[f"{m}.over_default.b{b}"] = r["BI_nemotron"][b]
        if "served" in nl:
            m = f"served.{MODELS['nemotron']}"
            out |= {f"{m}.steps_per_s": nl["served"]["denoising_steps_per_s"],
                    f"{m}.bare_steps_per_s": nl["batch1"]["denoising_steps_per_s"], f"{m}.P2": r.get("P2")}
    if dg := r.get("diffusion_gemma_26b"):
        m, steady = f"bf16.{MODELS['gemma']}", dg["steady_step_s"]
        out |= {f"{m}.step_ms.c1": ms(statistics.median(steady["with_self_conditioning"])),
                f"{m}.step_ms_without_self_conditioning.c1": ms(statistics.median(steady["without_self_conditioning"])),
                f"{m}.SC": r.get("SC"), f"{m}.floor_ms": ms(dg["floor_s"]), f"{m}.P1": r.get("P1_diffusion_gemma")}
        for n in (256, 768):
            out[f"{m}.tok_s.n{n}"] = dg["ours"][n]["tok_per_s"]
            if "transformers" in dg:
                out[f"transformers.{MODELS['gemma']}.tok_s.n{n}"] = dg["transformers"][n]["tok_per_s"]
                out[f"{m}.over_transformers.n{n}"] = r["P3"][n]
        if "batch_invariant_steady_step_s" in dg:
            m = f"batch_invariant.{MODELS['gemma']}"
            out[f"{m}.step_ms.c1"] = ms(statistics.median(dg["batch_invariant_steady_step_s"]))
            out[f"{m}.over_default.c1"] = r.get("BI_diffusion_gemma")
    for family, rows in (r.get("fp8") or {}).items():
        m, x = f"fp8.{MODELS[family]}", BATCH[family]
        fp8, bf16 = rows.get("fp8") or {}, rows.get("bf16") or {}
        out |= {f"{m}.floor_ms": ms(fp8.get("floor_s")), f"{m}.P1": fp8.get("P1"), f"{m}.bf16_P1": bf16.get("P1")}
        for b, ratio in (r.get(f"FP8_{family}") or {}).items():
            out |= {f"{m}.step_ms.{x}{b}": ms(fp8[f"batch{b}_step_s"]),
                    f"{m}.bf16_step_ms.{x}{b}": ms(bf16[f"batch{b}_step_s"]), f"{m}.over_bf16.{x}{b}": ratio}
    for family, speedups in tp_bench.speedups(r.get("P5") or {}).items():
        m, x = f"tp.{MODELS[family]}", BATCH[family]
        out |= {f"{m}.tp1_over_tp{tp_bench.TP}.{x}{b}": v for b, v in speedups.items()}
        out[f"{m}.allreduce_share"] = r["P5"][family].get("allreduce_share")
    for measured in (r.get("traffic") or {}).values():
        if "error" not in measured:
            out |= traffic.figures(measured)
    return out


def summary(r: dict) -> str:
    rows = [("P1 Nemotron-LD 8B: per-forward / weight-read floor", r.get("P1_nemotron"), "<= 1.11"),
            ("P1 DiffusionGemma 26B-A4B: per-forward / floor", r.get("P1_diffusion_gemma"), "<= 1.11"),
            ("P2 served / bare step rate", r.get("P2"), ">= 0.95"),
            ("P3 ours / transformers generate, 256 new", (r.get("P3") or {}).get(256), ">= 8"),
            ("P3 ours / transformers generate, 768 new", (r.get("P3") or {}).get(768), ">= 8"),
            ("P4 tok/s 16 concurrent / 1", r.get("P4"), ">= 8"),
            ("SC self-conditioning on / off step time", r.get("SC"), "<= 1.03"),
            ("BI batch-invariant / default step time, 8B batch 1", (r.get("BI_nemotron") or {}).get(1), "cost"),
            ("BI batch-invariant / default step time, 8B batch 16", (r.get("BI_nemotron") or {}).get(16), "cost"),
            ("BI batch-invariant / default step time, 26B-A4B", r.get("BI_diffusion_gemma"), "cost"),
            ("P1 FP8 Nemotron-LD 8B: per-forward / FP8 weight-read floor", r.get("P1_fp8_nemotron"), "<= 1.25"),
            ("P1 FP8 DiffusionGemma 26B-A4B: per-forward / FP8 floor", r.get("P1_fp8_gemma"), "<= 1.25"),
            ("FP8 / BF16 step time, 8B batch 1", (r.get("FP8_nemotron") or {}).get(1), "report"),
            ("FP8 / BF16 step time, 8B batch 16", (r.get("FP8_nemotron") or {}).get(16), "report"),
            ("FP8 / BF16 step time, 26B-A4B 1 canvas", (r.get("FP8_gemma") or {}).get(1), "report"),
            ("FP8 / BF16 step time, 26B-A4B 4 canvases", (r.get("FP8_gemma") or {}).get(4), "report"),
            *tp_bench.rows(r)]
    for family, measured in (r.get("traffic") or {}).items():
        from benchmarks.traffic import rows as traffic_rows

        rows += [(f"T {family}: the server did not start", None, "its log")] if "error" in measured else \
            [(f"T {family}: {name}", value, target) for name, value, target in traffic_rows(measured)]
    width = max(58, *(len(name) for name, _, _ in rows))
    lines = [f"{'ratio':{width}} {'measured':>9}  target"]
    lines += [f"{name:{width}} {value:9.3f}  {target}" if value is not None else f"{name:{width}} {'-':>9}  {target}"
              for name, value, target in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
