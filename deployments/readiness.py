"""Whether the model would serve a request now, answered within bounds, and the 503 that says why not.

While no coordinator replica runs (one loads weights and captures CUDA graphs for minutes, or waits for
its placement group), Serve holds every call to the deployment until one does; a running coordinator
answers its stats at once. So every call the ingress makes to the coordinator goes through here: a
bounded wait, and a failure turned into a 503 naming the reason (warming up, pending placement,
rebuilding, down, failed to deploy).
"""
from __future__ import annotations

import asyncio

from ray.exceptions import RayError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.errors import ERROR_STATUS, APIError
from deployments.placement import PlacementWatch

HEALTH_DETAIL = ("num_slots", "free_slots", "running", "waiting", "shard_failures", "kv_cache_tokens",
                 "kv_cache_usage")
# A running coordinator answers its stats at once, so no answer within STATS_S means none is ready.
STATS_S, SHARD_PING_S = 2.0, 15.0
HELD_PROBE_S = 0.25   # a stats call's bound while an earlier one is still held (ready_stats)
WARMING_UP = "warming up: no model replica is ready yet (loading weights, capturing CUDA graphs)"
STATE_REASON = {"starting": WARMING_UP, "rebuilding": "rebuilding the model shards after a failure",
                "down": "the model shards are down and could not be rebuilt"}


def _last_line(err: Exception) -> str:
    """A remote exception's own message (Ray prefixes the whole remote traceback)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


class Readiness:
    """The ingress's view of its coordinator deployment: ready or not, and why."""

    def __init__(self, coordinator: DeploymentHandle, placement: PlacementWatch):
        self.coordinator = coordinator
        self.placement = placement
        self.model_ready = False   # once the coordinator said so: requests then go straight to it
        self._held_stats: asyncio.Future | None = None   # the stats call Serve holds while no replica runs

    async def health(self) -> dict:
        """/health's answer: the slot counts once the coordinator is ready and its shards answer a ping (a
        leak shows as free_slots below num_slots while nothing runs); a 503 with the reason otherwise."""
        stats = await self.ready_stats()
        await self.bounded(self.coordinator.check_health.remote(), SHARD_PING_S, "the model shards did not answer")
        return {"status": "ok", **{k: stats[k] for k in HEALTH_DETAIL}}

    async def check_serving(self) -> None:
        """A 503 now, rather than a request held until a replica warms up; once ready, nothing to ask."""
        if not self.model_ready:
            await self.ready_stats()
            self.model_ready = True

    async def bounded(self, response, timeout_s: float, reason: str | None = None):
        """A coordinator call's result; 503 with `reason` if no replica answers within timeout_s (reason None:
        say whether it waits for its placement group or warms up), or with Ray's reason if it failed."""
        try:
            return await asyncio.wait_for(self.answer(response), timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise self.not_running(reason) from None

    async def answer(self, response):
        """A coordinator call's result, its failure as a 503 saying why."""
        try:
            return await response
        except DeploymentUnavailableError as err:   # it failed to deploy: say why, if placement is why
            raise self.failed_to_deploy(err) from None
        except RayError as err:
            raise APIError(503, f"unhealthy: {_last_line(err)}", "service_unavailable",
                           headers={"Retry-After": "1"}) from None

    async def next_output(self, stream):
        """The next output of a coordinator stream, None at its end; its errors as APIError (the engine's
        own with their status, a replica that died or was replaced a 503)."""
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return None
        except DeploymentUnavailableError as err:
            raise self.failed_to_deploy(err) from None
        except (RayError, RuntimeError) as err:
            raise APIError(503, f"the model replica failed: {type(err).__name__}", "service_unavailable",
                           headers={"Retry-After": "1"}) from None
        if "error" in item:
            status, type_ = ERROR_STATUS.get(item["error"], (500, "internal_error"))
            headers = {"Retry-After": "1"} if status in (429, 503) else None
            raise APIError(status, item["message"], type_, item["param"], headers)
        return item["output"]

    def not_running(self, reason: str | None = None) -> APIError:
        """No replica runs: `reason`, else whether it waits for its placement group or warms up."""
        return APIError(503, reason or self.placement.reason() or WARMING_UP, "service_unavailable",
                        headers={"Retry-After": "5"})

    def failed_to_deploy(self, err: DeploymentUnavailableError) -> APIError:
        reason = self.placement.reason()
        return APIError(503, err.message + (f" {reason}" if reason else ""), "service_unavailable")

    async def ready_stats(self) -> dict:
        """The coordinator's stats if it is ready; 503 with what it is doing otherwise. While no replica
        runs, Serve holds the stats call until one does: the first caller waits STATS_S for it and leaves
        it held, and every caller while it is still held waits HELD_PROBE_S at most (a load balancer
        polling /health during a warm-up of minutes sees answers in a fraction of a second, not every
        STATS_S)."""
        held = self._held_stats
        if held is not None and not held.done():
            # a fresh call still answers at once where a replica runs by now, or where the deployment
            # failed meanwhile (Serve's reason, which the held call does not get)
            stats = await self.bounded(self.coordinator.stats.remote(), HELD_PROBE_S)
        else:
            if held is not None and not held.cancelled():
                held.exception()   # an answer that came after its caller left: retrieved, then dropped
            self._held_stats = held = asyncio.ensure_future(self.answer(self.coordinator.stats.remote()))
            done, _ = await asyncio.wait({held}, timeout=STATS_S)
            if not done:
                raise self.not_running()
            self._held_stats = None
            stats = held.result()
        if stats["state"] != "ready":
            raise APIError(503, STATE_REASON.get(stats["state"], stats["state"]), "service_unavailable",
                           headers={"Retry-After": "5"})
        return stats
