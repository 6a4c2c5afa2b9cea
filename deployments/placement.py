"""A model replica's placement group: whether the cluster can ever hold it (`never_placed`, checked when
the app is built), and, once deployed, the groups Serve makes for the Coordinator's replicas, watched
by the ingress (`PlacementWatch`).

Serve creates a replica's placement group (named as the replica's actor) before the replica exists, so
the replica cannot see its own group pending: the ingress, which runs without one, watches them. When a
group is still pending after `placement_timeout_s`, or the cluster can never hold it (the cluster
shrank, or the app was built without a Ray connection), the watch kills the replica's pending actor: that
fails the replica's start (Serve retries it, and after 3 failed starts in a row of a deployment that
never ran marks it DEPLOY_FAILED). While one is
pending, /health answers 503 saying what the group asks and what is missing.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.util.placement_group import placement_group_table

from deployments.args import AppArgs
from deployments.cluster import ClusterResources, counts, fmt_resources, sum_resources, unplaceable

log = logging.getLogger("dllm.placement")

POLL_S = 1.0


def placement_hint(device: str, cluster: ClusterResources) -> str:
    span = ", let a replica span nodes (placement_strategy=PACK)" if len(cluster.nodes) > 1 else ""
    cpu = ", or give shards a fraction of a CPU (shard_cpus=0.5: they then share cores)" if device == "cpu" else ""
    return f"Lower tensor_parallel_size or the replicas{span}, add nodes{cpu}"


def never_placed(args: AppArgs, device: str, bundles: list[dict], cluster: ClusterResources) -> str | None:
    """The deploy error when the cluster can never hold the replicas Serve starts with, else None."""
    problem = unplaceable(bundles, args.placement_strategy, args.initial_replicas(), cluster)
    if problem is None:
        return None
    return (f"tensor_parallel_size={args.tensor_parallel_size} on device={device} cannot be placed: {problem}. "
            f"{placement_hint(device, cluster)}.")


def missing(bundles: list[dict], strategy: str, free: list[dict]) -> str:
    """What the free resources lack for `bundles`, in words."""
    need = sum_resources(bundles)
    if strategy == "STRICT_PACK":
        def short(node: dict) -> dict:
            return {k: v - node.get(k, 0.0) for k, v in need.items() if v > node.get(k, 0.0)}
        best = min(free, key=lambda n: sum(short(n).values()), default={})
        return f"{fmt_resources(short(best))} more on one node (the most free on one node: {fmt_resources(best)})"
    lack = {k: v - sum(n.get(k, 0.0) for n in free) for k, v in need.items()}
    lack = {k: v for k, v in lack.items() if v > 0}
    if lack:
        return f"{fmt_resources(lack)} more in the cluster"
    return "enough in all, but not as whole bundles on the free nodes" + \
        (" (each bundle on a different node)" if strategy == "STRICT_SPREAD" else "")


class PlacementWatch:
    """The placement groups of one app's Coordinator replicas, polled from the ingress every POLL_S."""

    def __init__(self, app_name: str, args: AppArgs, deployment: str = "Coordinator"):
        self.prefix = f"{REPLICA_ID_FULL_ID_STR_PREFIX}{app_name}#{deployment}#"
        self.args = args
        self.first_seen: dict[str, float] = {}   # pending group id -> when this watch first saw it pending
        self.pending: str | None = None          # /health's reason while a group is pending
        self.failed: str | None = None           # the last group this watch removed, and why

    def reason(self) -> str | None:
        """Why no replica answers, if placement is why (None: it is not)."""
        if self.pending is not None:
            return self.pending
        return self.failed

    async def run(self) -> None:
        """Polls until cancelled, or until the replica shuts down (its thread pool then takes no more work)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                poll = loop.run_in_executor(None, self.poll)
            except RuntimeError:   # the executor is shut down: the replica is stopping, and so is the watch
                return
            try:
                await asyncio.wait_for(poll, 10 * POLL_S)
            except Exception as err:  # noqa: BLE001 - a GCS hiccup must not end the watch
                log.warning("placement watch: %s: %s", type(err).__name__, err)
            await asyncio.sleep(POLL_S)

    def poll(self) -> None:
        ours = [g for g in placement_group_table().values() if g["name"].startswith(self.prefix)]
        if any(g["state"] == "CREATED" for g in ours):   # a replica placed since: a failure is history
            self.failed = None
        groups = [g for g in ours if g["state"] == "PENDING"]
        now = time.monotonic()
        self.first_seen = {g["placement_group_id"]: self.first_seen.get(g["placement_group_id"], now) for g in groups}
        if not groups:
            self.pending = None
            return
        cluster = ClusterResources.read()
        free = [{k: v for k, v in r.items() if counts(k)}
                for r in ray._private.state.available_resources_per_node().values()]
        reasons = []
        for g in groups:
            bundles = [g["bundles"][i] for i in sorted(g["bundles"])]
            waited = now - self.first_seen[g["placement_group_id"]]
            what = (f"tensor_parallel_size={self.args.tensor_parallel_size} asks {bundles} ({g['strategy']}); "
                    f"missing: {missing(bundles, g['strategy'], free)}")
            never = unplaceable(bundles, g["strategy"], 1, cluster)
            if never is not None or waited >= self.args.placement_timeout_s:
                why = f"can never be placed ({never})" if never is not None else \
                    f"was still pending after placement_timeout_s={self.args.placement_timeout_s:g}"
                self.failed = (f"placement failed: a model replica's start was failed (Serve retries it) because its "
                               f"placement group {why}; {what}")
                log.error(self.failed)
                self._fail(g["name"])
                continue
            reasons.append(f"pending placement: a model replica has waited {waited:.0f} s for its placement group: "
                           f"{what}; it fails after placement_timeout_s={self.args.placement_timeout_s:g}")
        self.pending = reasons[0] if reasons else None

    @staticmethod
    def _fail(replica: str) -> None:
        """Kills the pending replica actor (named as its group): Serve sees its start fail, removes the group,
        and retries. (Removing the group instead leaves the actor pending for good.)"""
        try:
            ray.kill(ray.get_actor(replica, namespace=SERVE_NAMESPACE), no_restart=True)
        except ValueError:   # gone already
            pass
