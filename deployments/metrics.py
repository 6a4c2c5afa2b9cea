"""`GET /metrics`: the coordinator's counters (SPEC.md section 8) and queue state as Prometheus text."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = {
    "committed_tokens": "Tokens committed (emitted) by canvases, AR steps and accepted drafts",
    "denoising_steps": "Denoising forwards per slot (commit steps excluded)",
    "canvas_positions": "Canvas positions evaluated by denoising forwards",
    "canvases": "Canvases committed",
    "forwards": "Model forwards per slot, of every step kind",
}
GAUGES = {"running": "Requests holding a slot", "waiting": "Requests waiting for a slot",
          "free_slots": "Free slots", "num_slots": "Slots"}


class _Snapshot:
    def __init__(self, stats: dict, model: str):
        self.stats, self.model = stats, model

    def collect(self):
        for name, doc in COUNTERS.items():
            c = CounterMetricFamily(f"dllm_{name}", doc, labels=["model"])
            c.add_metric([self.model], self.stats["counters"][name])
            yield c
        for name, doc in GAUGES.items():
            g = GaugeMetricFamily(f"dllm_{name}", doc, labels=["model"])
            g.add_metric([self.model], self.stats[name])
            yield g
        f = CounterMetricFamily("dllm_shard_failures", "Shard group failures recovered from", labels=["model"])
        f.add_metric([self.model], self.stats["shard_failures"])
        yield f
        for name, value in self.stats["derived"].items():
            if value is not None:
                g = GaugeMetricFamily(f"dllm_{name}", f"Derived: {name.replace('_', ' ')}", labels=["model"])
                g.add_metric([self.model], value)
                yield g


def prometheus_text(stats: dict, model: str) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model))
    return generate_latest(registry).decode()
