"""`make soak-gpu`: a soak of the served full-size shapes under mixed traffic, bounded in time, per family.

    python3 scripts/soak_gpu.py [--family nemotron-ld|diffusion-gemma] [--seconds S] [--server-tree PATH]

It starts the server as benchmarks/traffic.py does (dummy weights), then --clients clients send the
family's request mix (whole answers, streams, streams with drafts, streams whose client hangs up), with
one burst of 256 requests half way that must each get a whole answer or a 429; every answer is checked,
and GPU memory, resident memory and /health are sampled. It saves soak-FAMILY.json and the server's log
in --out-dir, and exits 1 on an error, a leak or a slot not free at the end, 2 if a server did not start,
130 when interrupted (after saving what it counted).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for benchmarks/

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.http_checks import abandon_stream, assert_refused, burst, check_answer, outcome  # noqa: E402
from benchmarks.request_mix import Draw, Mix, load_mix  # noqa: E402
from benchmarks.server_process import (REPO, ServerError, ServerProcess, gpu_memory_mib, scrape_metrics,  # noqa: E402
                                       tree_commit, tree_rss_mib)
from benchmarks.traffic import FAMILIES, write_model  # noqa: E402

COMPLETIONS = "/v1/completions"
KINDS = ("whole", "stream", "drafts", "hangup")
KIND_WEIGHTS = (0.35, 0.30, 0.15, 0.20)
BURST = 256
MIN_SOAK_S = 20.0   # a soak shortened by --within still runs this long: its burst and a few of each kind
RSS_GROWTH = 1.10


def settle_s(seconds: float) -> float:
    """The first seconds of a soak of `seconds`, left out of its memory trends (the allocator settles)."""
    return min(30.0, seconds / 5)


def soak_seconds(opts: argparse.Namespace, start_s: float) -> float:
    """How long to soak once the server answered `start_s` seconds after its start: --seconds, shortened
    where --within bounds the whole run (a cold start on a GPU host takes 3-5 minutes, and a soak cut off
    by the caller's time limit reports nothing)."""
    if opts.within is None:
        return opts.seconds
    return max(MIN_SOAK_S, min(opts.seconds, opts.within - start_s - opts.within_reserve))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 scripts/soak_gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=list(FAMILIES), help="default: both, one after the other")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("DLLM_SOAK_S", "240")),
                   help="of traffic per family (default: $DLLM_SOAK_S, else 240)")
    p.add_argument("--within", type=float, default=os.environ.get("DLLM_SOAK_WITHIN_S") or None,
                   help="seconds for one family's whole run, its start included: the soak is shortened to "
                        "what the start leaves of it less --within-reserve (at least MIN_SOAK_S; default: "
                        "$DLLM_SOAK_WITHIN_S, else no bound but --seconds)")
    p.add_argument("--within-reserve", type=float, default=90.0,
                   help="of --within, kept for what follows the soak: the last requests, the idle check, the stop")
    p.add_argument("--clients", type=int, default=8, help="in flight at once besides the burst (at most "
                                                          "max_num_seqs + max_queue: never a 429 of their own)")
    p.add_argument("--server-tree", type=Path, default=REPO)
    p.add_argument("--model", help="a checkpoint directory instead of the full-size shapes (needs --family)")
    p.add_argument("--work", type=Path, default=Path("/tmp/dllm-traffic"), help="where the shapes are written")
    p.add_argument("--server-arg", action="append", default=["load_format=dummy", "max_num_seqs=8"],
                   metavar="KEY=VALUE", help="serve_local arguments (repeatable; added to load_format=dummy "
                                             "max_num_seqs=8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=997, help="prompt token ids are drawn from [0, this)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory and /health samples")
    p.add_argument("--gpu-slack-mib", type=float, default=256.0)
    p.add_argument("--rss-slack-mib", type=float, default=512.0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request, the burst's too")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".")))
    opts = p.parse_args(argv)
    if opts.model and not opts.family:
        p.error("--model needs --family")
    return opts


# ---- the traffic -------------------------------------------------------------------------------------

@dataclass
class Soak:
    """What the clients, the burst and the sampler share (one event loop: no locks)."""

    url: str
    model: str
    mix: Mix
    opts: argparse.Namespace
    deadline: float
    burst_epoch: int = 0          # +1 when the burst starts and when it ends
    burst_active: bool = False
    done: bool = False
    requests: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    examples: dict = field(default_factory=dict)
    expected_429: int = 0
    drafts: int = 0
    tokens: int = 0
    burst: dict | None = None
    samples: list = field(default_factory=list)

    def error(self, kind: str, message: str, body: dict | None = None) -> None:
        self.errors[kind] += 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < 3:
            shown.append({"message": message[:500],
                          "body": None if body is None else {k: v for k, v in body.items() if k != "prompt"}})

    def counted(self) -> dict:
        """What the traffic came to, as the report (whole or interrupted) holds it."""
        return {"requests": dict(self.requests), "completion_tokens": self.tokens, "drafts": self.drafts,
                "errors": dict(self.errors), "error_examples": self.examples, "expected_429": self.expected_429,
                "burst": self.burst, "samples": self.samples}

    def overlapped_burst(self, epoch: int) -> bool:
        """Whether the burst ran at any time since `epoch` was read."""
        return self.burst_active or epoch != self.burst_epoch


def diffusion_mode(draw: Draw) -> bool:
    return draw.options.get("diffusion", {}).get("mode", "diffusion") == "diffusion"


def make_body(s: Soak, draw: Draw, rng: np.random.Generator, kind: str) -> dict:
    body = {"model": s.model, "prompt": rng.integers(0, s.opts.vocab, size=draw.prompt_len).tolist(),
            "max_tokens": draw.max_tokens, **draw.options, "ignore_eos": True}
    if kind != "whole":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "drafts" or (kind == "hangup" and diffusion_mode(draw)):
        body["diffusion"] = {**body.get("diffusion", {}), "stream_drafts": True,
                             "draft_every": int(rng.choice([1, 2, 4, 8]))}
    return body


def count_drafts(raw: str) -> int:
    """The draft comment lines of a stream, each checked to be a draft of the canvas."""
    n = 0
    for line in raw.splitlines():
        if line.startswith(": draft "):
            draft = json.loads(line[len(": draft "):])
            assert draft["object"] == "draft" and len(draft["tokens"]) == len(draft["known"]), line[:200]
            n += 1
    return n


async def client(s: Soak, http: httpx.AsyncClient, index: int) -> None:
    rng = np.random.default_rng([s.opts.seed, 100 + index])
    while time.monotonic() < s.deadline:
        draw = s.mix.draw(1, rng)[0]
        kind = str(rng.choice(KINDS, p=KIND_WEIGHTS))
        if kind == "drafts" and not diffusion_mode(draw):
            kind = "stream"
        body = make_body(s, draw, rng, kind)
        epoch = s.burst_epoch
        status = None
        try:
            if kind == "hangup":
                chunks = int(rng.integers(1, 4))
                seen = await abandon_stream(http, s.url, body, chunks)
                s.requests["hangup" if seen == chunks else "hangup (ended first)"] += 1
                continue
            out = await outcome(http, s.url, body)
            status = out["status"]
            if status == 429 and s.overlapped_burst(epoch):
                assert_refused(out)
                s.expected_429 += 1
                await asyncio.sleep(float(out["retry_after"] or 1))
                continue
            s.tokens += check_answer(COMPLETIONS, body, status, out["raw"])
            if kind == "drafts":
                s.drafts += count_drafts(out["raw"])
            s.requests[kind] += 1
        except AssertionError as err:
            message = str(err)
            if message.startswith("HTTP 429") and s.overlapped_burst(epoch):   # a hang-up's stream refused
                s.expected_429 += 1
                await asyncio.sleep(1)
                continue
            if status not in (None, 200) or message.startswith("HTTP "):
                what = f"HTTP {status}" if status not in (None, 200) else message.split(":")[0]
            else:
                what = "error event" if '{"error"' in message else "bad answer"
            s.error(f"{kind}: {what}", message, body)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as err:
            s.error(f"{kind}: {type(err).__name__}", str(err), body)


async def run_burst(s: Soak, at: float) -> None:
    """BURST requests at once at time `at`: each a whole answer (checked) or a 429 (queue full)."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    rng = np.random.default_rng([s.opts.seed, 7])
    bodies = [make_body(s, draw, rng, "stream" if i % 2 == 0 else "whole")
              for i, draw in enumerate(s.mix.draw(BURST, rng))]
    s.burst_active, s.burst_epoch = True, s.burst_epoch + 1
    t = time.monotonic()
    try:
        results = await burst(s.url, bodies, s.opts.request_timeout)
    except (asyncio.TimeoutError, httpx.HTTPError) as err:
        s.error("burst: no answer", f"{type(err).__name__}: {err}")
        return
    finally:
        s.burst_active, s.burst_epoch = False, s.burst_epoch + 1
    statuses = collections.Counter(out["status"] for out in results)
    for body, out in zip(bodies, results):
        try:
            if out["status"] == 429:
                assert assert_refused(out)["type"] == "rate_limit_exceeded", out["body"]
            else:
                check_answer(COMPLETIONS, body, out["status"], out["raw"])
        except AssertionError as err:
            s.error(f"burst: HTTP {out['status']}" if out["status"] not in (200, 429) else "burst: bad answer",
                    str(err), body)
    s.burst = {"requests": BURST, "statuses": {str(k): v for k, v in sorted(statuses.items())},
               "s": time.monotonic() - t, "slowest_s": max(out["s"] for out in results)}


async def sample(s: Soak, http: httpx.AsyncClient, server: ServerProcess, t0: float) -> None:
    while not s.done:
        gpu = await asyncio.to_thread(gpu_memory_mib)
        rss = await asyncio.to_thread(tree_rss_mib, server.proc.pid)
        row = {"t": time.monotonic() - t0, "gpu_mib": gpu, "rss_mib": rss, "burst": s.burst_active}
        try:
            r = await http.get(f"{server.base}/health", timeout=30)
            row["health"] = r.status_code
            if r.status_code == 200:
                h = r.json()
                row |= {k: h.get(k) for k in ("num_slots", "free_slots", "running", "waiting")}
                if h["running"] + h["free_slots"] != h["num_slots"]:
                    s.error("health: slots inconsistent", json.dumps(h))
            else:
                s.error(f"health: HTTP {r.status_code}", r.text[:300])
        except (httpx.HTTPError, ValueError, KeyError) as err:
            row["health"] = None
            s.error(f"health: {type(err).__name__}", str(err))
        s.samples.append(row)
        await asyncio.sleep(s.opts.sample_every)


async def idle_slots(http: httpx.AsyncClient, base: str, timeout_s: float) -> dict | None:
    """/health once nothing runs or waits (or its last answer when `timeout_s` passes; None if none)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            r = await http.get(f"{base}/health", timeout=30)
            if r.status_code == 200:
                last = r.json()
                if last["free_slots"] == last["num_slots"] and last["running"] == 0 and last["waiting"] == 0:
                    return last
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(1)
    return last


# ---- one family --------------------------------------------------------------------------------------

def memory_trend(samples: list[dict], key: str, after_s: float) -> dict | None:
    """Median of the first third of the samples after `after_s` against the last third."""
    values = [row[key] for row in samples if row["t"] >= after_s and row[key] is not None]
    if len(values) < 3:
        return None
    third = len(values) // 3
    first, last = statistics.median(values[:third]), statistics.median(values[-third:])
    return {"first_third_mib": first, "last_third_mib": last, "growth_mib": last - first, "samples": len(values)}


async def soak_family(opts: argparse.Namespace, family: str, server: ServerProcess, progress: dict) -> dict:
    """The soak; `progress` holds the cold start and the Soak as they come, for a report if interrupted."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=opts.request_timeout, limits=limits) as http:
        cold = await server.wait_ready(http, opts.start_timeout, {"prompt": [1] * 16, "max_tokens": 16,
                                                                 "ignore_eos": True})
        progress["cold_start"] = cold
        seconds = progress["seconds"] = soak_seconds(opts, cold["first_completion_s"])
        print(f"{family}: first completion {cold['first_completion_s']:.0f} s after the start; soaking "
              f"{seconds:.0f} s" + (f" (of {opts.seconds:.0f}: --within {opts.within:.0f})"
                                     if seconds < opts.seconds else ""), flush=True)
        metrics_before = await scrape_metrics(http, server.base)
        t0 = time.monotonic()
        s = progress["soak"] = Soak(server.base + COMPLETIONS, cold["model"], load_mix(family), opts, t0 + seconds)
        sampler = asyncio.create_task(sample(s, http, server, t0))
        bursting = asyncio.create_task(run_burst(s, t0 + seconds / 2))
        clients = [asyncio.create_task(client(s, http, i)) for i in range(opts.clients)]
        try:
            await asyncio.wait_for(asyncio.gather(*clients, bursting), seconds + opts.request_timeout + 60)
        except asyncio.TimeoutError:
            s.error("soak: clients did not finish", f"within {opts.request_timeout + 60:.0f} s of the end")
        s.done = True
        await sampler
        idle = await idle_slots(http, server.base, 120)
        metrics_after = await scrape_metrics(http, server.base)
        elapsed = time.monotonic() - t0
    warmup_s = settle_s(seconds)
    gpu, rss = memory_trend(s.samples, "gpu_mib", warmup_s), memory_trend(s.samples, "rss_mib", warmup_s)
    leaks = []
    if gpu is not None and gpu["growth_mib"] > opts.gpu_slack_mib:
        leaks.append(f"GPU memory {gpu['first_third_mib']:.0f} -> {gpu['last_third_mib']:.0f} MiB")
    if rss is not None and rss["last_third_mib"] > RSS_GROWTH * rss["first_third_mib"] + opts.rss_slack_mib:
        leaks.append(f"resident memory {rss['first_third_mib']:.0f} -> {rss['last_third_mib']:.0f} MiB")
    slots_free = idle is not None and idle["free_slots"] == idle["num_slots"] and idle["running"] == 0 \
        and idle["waiting"] == 0
    if s.requests["drafts"] and not s.drafts:
        s.error("drafts: none streamed", f"{s.requests['drafts']} requests asked for drafts")
    if s.burst is None and not any(k.startswith("burst") for k in s.errors):
        s.error("burst: did not run", "the soak ended before it")
    return {"family": family, "seconds": elapsed, "soak_s": seconds, "cold_start": cold, "clients": opts.clients,
            **s.counted(), "gpu_memory": gpu, "resident_memory": rss, "leaks": leaks,
            "health_at_end": idle, "slots_free_at_end": slots_free,
            "metrics_before": metrics_before, "metrics_after": metrics_after,
            "passed": not s.errors and not leaks and slots_free}


def report(r: dict) -> str:
    def mem(m):
        return "-" if m is None else f"{m['first_third_mib']:.0f} -> {m['last_third_mib']:.0f} MiB"

    h = r["health_at_end"] or {}
    lines = [f"soak {r['family']}: {'PASSED' if r['passed'] else 'FAILED'} after {r['seconds']:.0f} s, "
             f"{r['clients']} clients",
             f"  requests: {r['requests']} ({r['completion_tokens']} completion tokens, {r['drafts']} drafts)",
             f"  burst of {BURST}: {(r['burst'] or {}).get('statuses')}; 429s to the clients during it: "
             f"{r['expected_429']}",
             f"  errors: {r['errors'] or 0}",
             f"  GPU memory (first third -> last third): {mem(r['gpu_memory'])}; resident: {mem(r['resident_memory'])}"
             + (f"; LEAK: {r['leaks']}" if r["leaks"] else ""),
             f"  slots free at the end: {h.get('free_slots')} of {h.get('num_slots')}",
             f"  graph captures while soaking: {r['metrics_before']['dllm_graph_captures_total']} -> "
             f"{r['metrics_after']['dllm_graph_captures_total']}"]
    for kind, examples in r["error_examples"].items():
        lines.append(f"  {kind}: {examples[0]['message'][:300]}")
    return "\n".join(lines)


def interrupted(family: str, progress: dict) -> dict:
    """What an interrupted soak had counted (no verdict: its checks at the end did not run)."""
    s: Soak | None = progress.get("soak")
    out = {"family": family, "interrupted": True, "cold_start": progress.get("cold_start")}
    if s is not None:
        out |= {**s.counted(),
                # the trends so far, leaving out what the whole soak would
                "gpu_memory": memory_trend(s.samples, "gpu_mib", settle_s(progress["seconds"])),
                "resident_memory": memory_trend(s.samples, "rss_mib", settle_s(progress["seconds"]))}
    return out


def run_family(opts: argparse.Namespace, family: str) -> dict:
    model = opts.model or write_model(family, opts.work)
    log = opts.out_dir / f"soak-{family}-server.log"
    server = ServerProcess(opts.server_tree, str(model), opts.server_arg, log)
    progress: dict = {}
    try:
        server.start()
        result = asyncio.run(soak_family(opts, family, server, progress))
    except KeyboardInterrupt:   # SIGTERM too (a caller's time limit): keep what was counted
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        partial = interrupted(family, progress)
        (opts.out_dir / f"soak-{family}.json").write_text(json.dumps(partial, indent=1, default=str))
        print(f"soak {family}: interrupted after {partial.get('requests')} requests, errors "
              f"{partial.get('errors') or 0}, burst {(partial.get('burst') or {}).get('statuses')}", flush=True)
        raise
    finally:
        status = server.stop()
    result |= {"server_tree": str(server.tree), "server_commit": tree_commit(server.tree),
               "server_command": server.command, "server_log": str(log), "server_exit_status": status}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / f"soak-{family}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def _terminate(signum, frame):
    raise KeyboardInterrupt   # the server is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    passed = True
    for family in [opts.family] if opts.family else list(FAMILIES):
        try:
            result = run_family(opts, family)
        except ServerError as err:
            print(f"soak {family}: the server did not start: {err}", flush=True)
            return 2
        except KeyboardInterrupt:
            print(f"soak {family}: interrupted; the server is stopped", flush=True)
            return 130
        print(report(result), flush=True)
        passed = passed and result["passed"]
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
