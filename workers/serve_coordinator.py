"""The Coordinator as a Ray Serve deployment: one replica = one model instance = one placement group
`[{"CPU": 1}] + [{"GPU": 1}] * tp` (bundle 0 holds this replica, bundles 1..tp its shards).

Its streaming `generate` yields plain dicts so that errors reach the ingress as data, not as
exceptions re-wrapped by Ray: {"output": RequestOutput} or {"error": kind, "message": ..., "param": ...}
(`param`: the request's field at fault, or None).
"""
from __future__ import annotations

from typing import AsyncIterator

from ray import serve

from model.sampling.params import DecodeParams
from workers.coordinator import Coordinator, RequestError


def placement_bundles(tp: int, use_gpu: bool) -> list[dict]:
    return [{"CPU": 1}] + [{"GPU": 1} if use_gpu else {"CPU": 1}] * tp


@serve.deployment(name="Coordinator", max_ongoing_requests=10_000, health_check_period_s=10,
                  health_check_timeout_s=60, graceful_shutdown_timeout_s=5)
class CoordinatorDeployment:
    def __init__(self, model_dir: str, tp: int, use_gpu: bool, runner_args: dict, engine_args: dict,
                 command_timeout_s: float = 120.0):
        # Here, not at the top: the shards' code (torch, the runner) loads in the replica that starts
        # shards, not in every process that imports this module (the ingress, to bind the application).
        from workers.ray_shards import RayShards

        runner_args = {"model_dir": model_dir, "device": "cuda" if use_gpu else "cpu", **runner_args}
        ctx = serve.get_replica_context()
        shards = RayShards(tp, runner_args, use_gpu=use_gpu, name=f"shard-{ctx.app_name}-{ctx.replica_id.unique_id}",
                           command_timeout_s=command_timeout_s)
        self.coordinator = Coordinator(model_dir, shards, **engine_args)

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
