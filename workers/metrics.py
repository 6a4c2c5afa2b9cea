"""Per-request distributions a dashboard plots, recorded by the coordinator as its requests' outputs
arrive: pure python (deployments/metrics.py renders them for Prometheus with the step counters, and
workers/ray_metrics.py exports them through Ray's metrics). The tables below name every series of the
coordinator's stats both exports carry.

Every number comes from the request's own record (workers/request.py): TTFT and the gaps between
blocks as `Request.extend` measures them, end-to-end latency at the finish, tokens per denoising step
of each finished request (its completion tokens / its denoising steps; AR requests have none).
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable

from workers.request import RequestOutput

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_STEP_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)

COUNTERS = {
    "committed_tokens": "Tokens committed (emitted) by canvases, AR steps and accepted drafts",
    "denoising_steps": "Denoising forwards per slot (commit steps excluded)",
    "canvas_positions": "Canvas positions evaluated by denoising forwards",
    "canvases": "Canvases committed",
    "forwards": "Model forwards per slot, of every step kind",
    "passes": "Batched model forward passes (each reads every weight once); forwards / passes is the rows a pass carries",
}
GAUGES = {"running": "Requests holding a slot", "waiting": "Requests waiting for a slot (the queue depth)",
          "free_slots": "Free slots", "num_slots": "Slots",
          "kv_cache_usage": "Share of the KV cache's pages requests hold or have reserved (0 to 1)",
          "kv_cache_tokens": "Positions the KV cache holds (its full-attention layers' pages x the page size)"}
HISTOGRAMS = {  # stats key -> (metric name, help)
    "ttft_s": ("dllm_time_to_first_token_seconds", "Time from admission to the queue to the first committed block"),
    "inter_block_s": ("dllm_inter_block_latency_seconds", "Time between two committed blocks of a request"),
    "e2e_s": ("dllm_e2e_request_latency_seconds", "Time from admission to the queue to the finish"),
    "tokens_per_step": ("dllm_tokens_per_step", "Completion tokens per denoising step, per finished request"),
}
SHARD_COUNTERS = (  # stats key, metric name, help
    ("prefix_cache_queries", "dllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "dllm_prefix_cache_hits", "Prompt tokens whose KV the prefix cache served"),
    ("shard_failures", "dllm_shard_failures", "Shard group failures recovered from"),
    ("shard_restarts", "dllm_shard_restarts", "Shard group starts after the first (rebuilds after a failure)"),
    ("shard_busy_s", "dllm_shard_busy_seconds", "Seconds the shards spent executing commands (rank 0's runner, "
     "host clock): its rate is the share of time the model is working"),
)
# CUDA graphs (model/graphs.py): the closed set captured at warm-up, and what happened outside it since
GRAPH_COUNTERS = (  # stats["graphs"] key, metric name, help
    ("eager_steps", "dllm_eager_steps", "Steps run outside a CUDA graph since the shards were ready (a plan "
     "outside the captured set, e.g. a prefill too wide for a graph)"),
    ("captured_after_ready", "dllm_graph_captures", "CUDA graphs captured while serving (0: all were captured "
     "before the replica was ready)"),
    ("kernel_compiles", "dllm_kernel_compiles", "Kernels compiled while serving (triton variants, torch.compile "
     "graphs; rank 0): each stalled every request of the replica while it compiled (0: the warm-up compiled "
     "every shape served)"),
)
FINISHED = ("dllm_finished_requests", "Requests finished by the engine, by finish reason (stop, length, abort)")
GRAPH_GAUGES = (  # stats["warm_up"] value, metric name, help
    (lambda w: sum((w.get("graphs") or {}).values()), "dllm_cuda_graphs", "CUDA graphs captured at warm-up"),
    (lambda w: w.get("graph_bytes", 0), "dllm_cuda_graph_memory_bytes", "Device memory the CUDA graphs hold (rank 0)"),
    (lambda w: w.get("seconds", 0.0), "dllm_warm_up_seconds", "Seconds the shards' warm-up (captures, compiles) took"),
)


class Histogram:
    """Prometheus semantics: bucket i counts observations <= bounds[i]; +Inf counts all."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        cumulative, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            cumulative.append((bound, total))
        return {"buckets": cumulative, "count": sum(self.counts), "sum": self.sum}


class RequestMetrics:
    def __init__(self):
        self.ttft_s = Histogram(LATENCY_BUCKETS_S)
        self.inter_block_s = Histogram(LATENCY_BUCKETS_S)
        self.e2e_s = Histogram(LATENCY_BUCKETS_S)
        self.tokens_per_step = Histogram(TOKENS_PER_STEP_BUCKETS)
        self.finished: Counter[str] = Counter()   # by finish reason: stop, length, abort
        # called with (histogram, value) for every observation: another export (Ray's metrics) of the same
        self.listeners: list[Callable[[str, float], None]] = []

    def observe(self, out: RequestOutput) -> None:
        for name in ("ttft_s", "inter_block_s", "e2e_s"):
            value = getattr(out, name)
            if value is not None:
                self._observe(name, value)
        if out.finished:
            self.finished[out.finish_reason] += 1
            if out.denoising_steps:
                self._observe("tokens_per_step", out.completion_tokens / out.denoising_steps)

    def _observe(self, name: str, value: float) -> None:
        getattr(self, name).observe(value)
        for listen in self.listeners:
            listen(name, value)

    def snapshot(self) -> dict:
        return {"histograms": {name: getattr(self, name).snapshot()
                               for name in ("ttft_s", "inter_block_s", "e2e_s", "tokens_per_step")},
                "finished": dict(self.finished)}
