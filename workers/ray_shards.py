"""The shard group of one model instance as Ray actors in the caller's placement group.

`RayShards.start()` waits (bounded) for the placement group's bundles (a rebuild after a lost node waits
for Ray to place them again), creates one ShardWorker per rank in bundles 1..tp, joins their process group,
loads weights and, once every rank has, warms them up together (on CUDA: compiles the steps' state
updates, model/steps/compiled.py); `execute(cmd)` sends every rank the same command and returns rank 0's events. Every
wait is bounded; any failure (a dead actor, a timeout) is a ShardFailure, after which the group is
torn down and can be started again.
"""
from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import get_current_placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from model.checkpoint import RunnerArgs
from model.protocol import Command, Events
from workers.failures import ShardFailure
from workers.shard import ShardWorker


class RayShards:
    def __init__(self, tp: int, runner_args: RunnerArgs, *, shard: dict, name: str = "shard",
                 start_timeout_s: float = 600.0, command_timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
                 placement_timeout_s: float = 300.0):
        self.tp, self.runner_args, self.shard = tp, runner_args, shard   # shard: one rank's {"GPU": 1} or {"CPU": n}
        self.placement_timeout_s = placement_timeout_s
        self.name, self.generation = name, 0  # actor names: <name>-<generation>-<rank>, for operators
        self.start_timeout_s, self.command_timeout_s = start_timeout_s, command_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.workers: list = []
        self.pids: list[int] = []   # of the live ranks, for operators (and the failure tests)
        self.warm_up_report: dict = {}   # rank 0's (model.runner.Runner.warm_up)

    def _options(self, rank: int) -> dict:
        opts = {"num_gpus": self.shard.get("GPU", 0), "num_cpus": self.shard.get("CPU", 0),
                "name": f"{self.name}-{self.generation}-{rank}"}
        pg = get_current_placement_group()
        if pg is not None:  # inside the coordinator's placement group: bundle 0 is the coordinator itself
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=1 + rank,
                placement_group_capture_child_tasks=True)
        return opts

    async def start(self) -> None:
        await self._placed()
        self.generation += 1
        self.workers = [ShardWorker.options(**self._options(r)).remote(r, self.tp, self.runner_args)
                        for r in range(self.tp)]
        try:
            address = await self._bounded(self.workers[0].rendezvous_address.remote(), self.start_timeout_s)
            await self._bounded(asyncio.gather(*[w.start.remote(address, self.collective_timeout_s)
                                                 for w in self.workers]), self.start_timeout_s)
            reports = await self._bounded(asyncio.gather(*[w.warm_up.remote() for w in self.workers]),
                                          self.start_timeout_s)
            self.warm_up_report = reports[0]
            self.pids = await self._bounded(asyncio.gather(*[w.pid.remote() for w in self.workers]), 30)
        except ShardFailure:
            self.stop()
            raise

    async def _placed(self) -> None:
        """Returns once the placement group holds every bundle: at once, unless a node it used was lost
        (Ray then places those bundles again, in state RESCHEDULING meanwhile); a ShardFailure after
        placement_timeout_s."""
        pg = get_current_placement_group()
        deadline = asyncio.get_running_loop().time() + self.placement_timeout_s
        while pg is not None:
            state = (await asyncio.to_thread(placement_group_table, pg))["state"]
            if state == "CREATED":
                return
            if asyncio.get_running_loop().time() > deadline:
                raise ShardFailure(f"the shards' placement group is {state}, not placed again within "
                                   f"placement_timeout_s={self.placement_timeout_s:g} (a node it used was lost)")
            await asyncio.sleep(0.5)

    async def execute(self, cmd: Command) -> Events:
        """The bound counts from the call: with overlapped commands it covers the one queued ahead too
        (commands take well under a second; the default bound is 120 s)."""
        refs = [w.execute.remote(cmd) for w in self.workers]
        results = await self._bounded(asyncio.gather(*refs), self.command_timeout_s)
        return results[0]

    async def ping(self, timeout_s: float = 10.0) -> None:
        await self._bounded(asyncio.gather(*[w.ping.remote() for w in self.workers]), timeout_s)

    async def _bounded(self, awaitable, timeout_s: float):
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except asyncio.TimeoutError:
            raise ShardFailure(f"a shard did not answer within {timeout_s:.0f} s") from None
        except ray.exceptions.RayError as err:  # a dead actor, a failed or a cancelled call
            lines = [line for line in str(err).splitlines() if line.strip()]
            raise ShardFailure(f"a shard failed: {type(err).__name__}: {lines[-1] if lines else ''}") from None

    def stop(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers, self.pids = [], []
