"""A coordinator replica's metrics through Ray's metrics, so that a dashboard covers every replica:
`ray.serve.metrics` tags each series with the application, deployment and replica, and every node's Ray
metrics endpoint exports the replicas on that node (Ray prefixes the names: `ray_dllm_...`); summed over
`replica`, a series is the whole deployment's. The series are the ingress /metrics' (workers/metrics.py
names them): counters and gauges copied from the coordinator's stats every EXPORT_S (a counter grows by
what it grew since the last copy), histograms observed as the coordinator observes them.
"""
from __future__ import annotations

import asyncio

from ray.serve.metrics import Counter, Gauge, Histogram

from workers.metrics import COUNTERS, FINISHED, GAUGES, GRAPH_COUNTERS, GRAPH_GAUGES, HISTOGRAMS, SHARD_COUNTERS

EXPORT_S = 1.0   # Ray itself reports every metrics_report_interval_ms (10 s unless the cluster sets it)


class RayMetricsExport:
    def __init__(self, coordinator, model: str):
        self.coordinator, self.tags = coordinator, {"model": model}
        self.counters: dict[str, Counter] = {}
        self.gauges: dict[str, Gauge] = {}
        self.sent: dict[tuple, float] = {}   # (counter, tag values) -> the total exported so far
        metrics = coordinator.metrics
        self.histograms = {key: Histogram(name, doc, boundaries=list(getattr(metrics, key).bounds),
                                          tag_keys=("model",)) for key, (name, doc) in HISTOGRAMS.items()}
        metrics.listeners.append(self.observe)

    def observe(self, key: str, value: float) -> None:
        self.histograms[key].observe(value, tags=self.tags)

    def update(self) -> None:
        s = self.coordinator.stats()
        for name, doc in COUNTERS.items():
            self._count(f"dllm_{name}", doc, s["counters"][name])
        for key, name, doc in SHARD_COUNTERS:
            self._count(name, doc, s[key])
        for key, name, doc in GRAPH_COUNTERS:
            self._count(name, doc, s["graphs"][key])
        for reason, n in s["finished"].items():
            self._count(*FINISHED, n, reason=reason)
        for name, doc in GAUGES.items():
            self._gauge(f"dllm_{name}", doc, s[name])
        for value, name, doc in GRAPH_GAUGES:
            self._gauge(name, doc, value(s["warm_up"]))
        for name, value in s["derived"].items():
            if value is not None:
                self._gauge(f"dllm_{name}", f"Derived: {name.replace('_', ' ')}", value)

    async def run(self) -> None:
        while True:
            self.update()
            await asyncio.sleep(EXPORT_S)

    def _count(self, name: str, doc: str, total: float, **tags) -> None:
        if name not in self.counters:
            self.counters[name] = Counter(name, doc, tag_keys=("model", *tags))
        key = (name, *tags.values())
        grown = total - self.sent.get(key, 0.0)
        if grown > 0:
            self.counters[name].inc(grown, tags={**self.tags, **tags})
            self.sent[key] = total

    def _gauge(self, name: str, doc: str, value: float) -> None:
        if name not in self.gauges:
            self.gauges[name] = Gauge(name, doc, tag_keys=("model",))
        self.gauges[name].set(value, tags=self.tags)
