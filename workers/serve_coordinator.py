"""The Coordinator as a Ray Serve deployment: one replica = one model instance = one placement group
`[{"CPU": 1}] + [shard bundle] * tp` (bundle 0 holds this replica, bundles 1..tp its shards: `{"GPU": 1}`,
or `{"CPU": shard_cpus}` on CPUs; Serve creates the group before the replica starts).

Its constructor starts the shards, which load their weights, capture their CUDA graphs and compile their
updates before Serve counts the replica as running; until then the ingress answers 503. Its streaming
`generate` yields plain dicts, {"output": RequestOutput} or {"error": kind, "message": ..., "param": ...},
so that errors reach the ingress as data, not as exceptions re-wrapped by Ray.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ray import serve

from model.checkpoint import RunnerArgs
from model.sampling.params import DecodeParams
from workers.coordinator import Coordinator, RequestError
from workers.prefix_router import ROUTED_PAGES, STATS_KEY, short
from workers.ray_metrics import RayMetricsExport


REPLICA_BUNDLE = {"CPU": 1}


def shard_bundle(use_gpu: bool, shard_cpus: float = 1.0) -> dict:
    """What one shard asks of its bundle (and of Ray, as its actor's resources)."""
    return {"GPU": 1} if use_gpu else {"CPU": shard_cpus}


def placement_bundles(tp: int, use_gpu: bool, shard_cpus: float = 1.0) -> list[dict]:
    return [dict(REPLICA_BUNDLE)] + [shard_bundle(use_gpu, shard_cpus)] * tp


@serve.deployment(name="Coordinator", max_ongoing_requests=10_000, health_check_period_s=10,
                  health_check_timeout_s=60, graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.25)
class CoordinatorDeployment:
    async def __init__(self, runner_args: RunnerArgs, tp: int, shard: dict, engine_args: dict,
                       command_timeout_s: float = 120.0, placement_timeout_s: float = 300.0, model_name: str = ""):
        # Here, not at the top: the shards' code (torch, the runner) loads in the replica that starts
        # shards, not in every process that imports this module (the ingress, to bind the application).
        from workers.ray_shards import RayShards

        ctx = serve.get_replica_context()
        shards = RayShards(tp, runner_args, shard=shard, name=f"shard-{ctx.app_name}-{ctx.replica_id.unique_id}",
                           command_timeout_s=command_timeout_s, placement_timeout_s=placement_timeout_s)
        self.coordinator = Coordinator(runner_args.checkpoint, shards, **engine_args)
        await self.coordinator.start()
        # this replica's series through Ray's metrics (every replica's, summed by the operator's Prometheus)
        self._export = asyncio.get_running_loop().create_task(RayMetricsExport(self.coordinator, model_name).run())

    async def generate(self, prompt: list[int], params: DecodeParams, request_id: str | None = None
                       ) -> AsyncIterator[dict]:
        try:
            async for out in self.coordinator.generate(prompt, params, request_id):
                yield {"output": out}
        except RequestError as err:
            yield {"error": err.kind, "message": err.message, "param": err.param}

    async def ready(self) -> bool:
        await self.coordinator.start()
        return True

    async def check_health(self) -> None:
        await self.coordinator.check_health()

    def stats(self) -> dict:
        return self.coordinator.stats()

    def record_routing_stats(self) -> dict:
        """What Serve's request router reads of this replica (workers/prefix_router.py): the addresses of
        the pages its KV cache holds, the full-attention group's (a prefix's pages exist in every group)."""
        pages = self.coordinator.scheduler.pages
        if pages is None:
            return {}
        return {STATS_KEY: [short(h) for h in pages.pools[0].addresses(ROUTED_PAGES)]}
