"""`GET /metrics`: Prometheus text for an operator's dashboard.

From the coordinator's stats (one source per number): the step counters (SPEC.md section 8), queue
and slot gauges, shard failures, restarts and busy seconds, requests by finish reason, and the
per-request histograms of workers/metrics.py. From this ingress process: HTTP requests to the
generation endpoints by endpoint and status (`RequestCounts`), counted where the status is decided (the
error handlers, the end of a JSON answer, the end of a stream).
"""
from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

COUNTERS = {
    "committed_tokens": "Tokens committed (emitted) by canvases, AR steps and accepted drafts",
    "denoising_steps": "Denoising forwards per slot (commit steps excluded)",
    "canvas_positions": "Canvas positions evaluated by denoising forwards",
    "canvases": "Canvases committed",
    "forwards": "Model forwards per slot, of every step kind",
}
GAUGES = {"running": "Requests holding a slot", "waiting": "Requests waiting for a slot (the queue depth)",
          "free_slots": "Free slots", "num_slots": "Slots"}
HISTOGRAMS = {  # stats key -> (metric name, help)
    "ttft_s": ("dllm_time_to_first_token_seconds", "Time from admission to the queue to the first committed block"),
    "inter_block_s": ("dllm_inter_block_latency_seconds", "Time between two committed blocks of a request"),
    "e2e_s": ("dllm_e2e_request_latency_seconds", "Time from admission to the queue to the finish"),
    "tokens_per_step": ("dllm_tokens_per_step", "Completion tokens per denoising step, per finished request"),
}
SHARD_COUNTERS = (  # stats key, metric name, help
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
)
GRAPH_GAUGES = (  # stats["warm_up"] value, metric name, help
    (lambda w: sum((w.get("graphs") or {}).values()), "dllm_cuda_graphs", "CUDA graphs captured at warm-up"),
    (lambda w: w.get("graph_bytes", 0), "dllm_cuda_graph_memory_bytes", "Device memory the CUDA graphs hold (rank 0)"),
    (lambda w: w.get("seconds", 0.0), "dllm_warm_up_seconds", "Seconds the shards' warm-up (captures, compiles) took"),
)
# the generation endpoints whose requests are counted: path suffix -> label
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


def endpoint_of(path: str) -> str | None:
    return next((e for suffix, e in ENDPOINTS.items() if path.endswith(suffix)), None)


class RequestCounts:
    """HTTP requests to the generation endpoints by (endpoint, status), in this ingress process. A stream's
    status is its HTTP status (200) unless an error ended it in band (that error's status) or the client
    went away first (499, nginx's "client closed request")."""

    def __init__(self):
        self.counts: Counter[tuple[str, str]] = Counter()

    def add(self, endpoint: str | None, status: int) -> None:
        if endpoint is not None:
            self.counts[(endpoint, str(status))] += 1


REQUESTS = RequestCounts()


class _Snapshot:
    def __init__(self, stats: dict, model: str, requests: RequestCounts):
        self.stats, self.model, self.requests = stats, model, requests

    def collect(self):
        s, model = self.stats, [self.model]
        for name, doc in COUNTERS.items():
            c = CounterMetricFamily(f"dllm_{name}", doc, labels=["model"])
            c.add_metric(model, s["counters"][name])
            yield c
        for name, doc in GAUGES.items():
            g = GaugeMetricFamily(f"dllm_{name}", doc, labels=["model"])
            g.add_metric(model, s[name])
            yield g
        for key, name, doc in SHARD_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(model, s[key])
            yield c
        c = CounterMetricFamily("dllm_requests", "HTTP requests to the generation endpoints by endpoint and status",
                                labels=["model", "endpoint", "status"])
        for (endpoint, status), n in sorted(self.requests.counts.items()):
            c.add_metric(model + [endpoint, status], n)
        yield c
        for key, name, doc in GRAPH_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(model, s["graphs"][key])
            yield c
        for value, name, doc in GRAPH_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(model, value(s["warm_up"]))
            yield g
        c = CounterMetricFamily("dllm_finished_requests", "Requests finished by the engine, by finish reason "
                                "(stop, length, abort)", labels=["model", "reason"])
        for reason, n in sorted(s["finished"].items()):
            c.add_metric(model + [reason], n)
        yield c
        for key, (name, doc) in HISTOGRAMS.items():
            h = s["histograms"][key]
            buckets = [(repr(float(le)), n) for le, n in h["buckets"]] + [("+Inf", h["count"])]
            m = HistogramMetricFamily(name, doc, labels=["model"])
            m.add_metric(model, buckets, sum_value=h["sum"])
            yield m
        for name, value in s["derived"].items():
            if value is not None:
                g = GaugeMetricFamily(f"dllm_{name}", f"Derived: {name.replace('_', ' ')}", labels=["model"])
                g.add_metric(model, value)
                yield g


def prometheus_text(stats: dict, model: str, requests: RequestCounts = REQUESTS) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model, requests))
    return generate_latest(registry).decode()
