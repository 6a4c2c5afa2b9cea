"""Per-request distributions a dashboard plots, recorded by the coordinator as its requests' outputs
arrive: pure python (deployments/metrics.py renders them for Prometheus with the step counters).

Every number comes from the request's own record (workers/request.py): TTFT and the gaps between
blocks as `Request.extend` measures them, end-to-end latency at the finish, tokens per denoising step
of each finished request (its completion tokens / its denoising steps; AR requests have none).
"""
from __future__ import annotations

import bisect
from collections import Counter

from workers.request import RequestOutput

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_STEP_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)


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

    def observe(self, out: RequestOutput) -> None:
        for name in ("ttft_s", "inter_block_s", "e2e_s"):
            value = getattr(out, name)
            if value is not None:
                getattr(self, name).observe(value)
        if out.finished:
            self.finished[out.finish_reason] += 1
            if out.denoising_steps:
                self.tokens_per_step.observe(out.completion_tokens / out.denoising_steps)

    def snapshot(self) -> dict:
        return {"histograms": {name: getattr(self, name).snapshot()
                               for name in ("ttft_s", "inter_block_s", "e2e_s", "tokens_per_step")},
                "finished": dict(self.finished)}
