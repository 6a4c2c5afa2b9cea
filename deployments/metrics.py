"""`GET /metrics`: Prometheus text for an operator's dashboard.

From the coordinator's stats (one source per number): the step counters (docs/spec.md section 8), queue
and slot gauges, shard failures, restarts and busy seconds, requests by finish reason, and the
per-request histograms of workers/metrics.py (the series named there; the coordinator replicas export
the same through Ray's metrics, workers/ray_metrics.py). From this ingress process: HTTP requests to the
generation endpoints by endpoint and status (`RequestCounts`), counted where the status is decided (the
error handlers, the end of a JSON answer, the end of a stream).
"""
from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from ray.serve import metrics as ray_metrics

# the series' names and help, shared with the coordinator replicas' export through Ray's metrics
from workers.metrics import (COUNTERS, FINISHED, GAUGES, GRAPH_COUNTERS, GRAPH_GAUGES,  # noqa: F401
                             HISTOGRAMS, SHARD_COUNTERS)

REQUESTS_HELP = "HTTP requests to the generation endpoints by endpoint and status"
# the generation endpoints whose requests are counted: path suffix -> label
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


def endpoint_of(path: str) -> str | None:
    return next((e for suffix, e in ENDPOINTS.items() if path.endswith(suffix)), None)


class RequestCounts:
    """HTTP requests to the generation endpoints by (endpoint, status), in this ingress process, and through
    Ray's metrics for every ingress replica (workers/ray_metrics.py says how). A stream's status is its
    HTTP status (200) unless an error ended it in band (that error's status) or the client went away first
    (499, nginx's "client closed request")."""

    def __init__(self, model: str = ""):
        self.model = model   # the ingress sets it: a tag of the Ray series
        self.counts: Counter[tuple[str, str]] = Counter()
        self.ray_counter = None   # made at the first count, in the replica: Serve tags it with the replica then

    def add(self, endpoint: str | None, status: int) -> None:
        if endpoint is not None:
            self.counts[(endpoint, str(status))] += 1
            if self.ray_counter is None:
                self.ray_counter = ray_metrics.Counter("dllm_requests", REQUESTS_HELP,
                                                       tag_keys=("model", "endpoint", "status"))
            self.ray_counter.inc(tags={"model": self.model, "endpoint": endpoint, "status": str(status)})


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
        c = CounterMetricFamily("dllm_requests", REQUESTS_HELP, labels=["model", "endpoint", "status"])
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
        c = CounterMetricFamily(*FINISHED, labels=["model", "reason"])
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
