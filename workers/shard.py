"""ShardWorker: a Ray actor holding one tensor-parallel rank (one GPU, or one CPU process with gloo).

Created by the coordinator in bundle `1 + rank` of its placement group. Rank 0 publishes the
rendezvous address; every rank joins the process group with a collective timeout, so a dead peer
fails a command instead of hanging it; loads only its own weight slices; executes commands.
"""
from __future__ import annotations

import datetime
import os
import socket

import ray
import torch

from model.checkpoint import RunnerArgs
from model.parallel.group import TPGroup
from model.parallel.small_allreduce import disable_multicast
from model.protocol import Command, Events
from model.runner import Runner


# `execute` runs in the default group (one thread: commands in order, one at a time); `ping` and `pid`
# in their own, so a health check answers while commands are queued behind the running one.
@ray.remote(concurrency_groups={"health": 1})
class ShardWorker:
    def __init__(self, rank: int, world_size: int, runner_args: RunnerArgs):
        self.rank, self.world_size = rank, world_size
        self.runner = None
        if runner_args.device.startswith("cuda"):
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here.
            torch.cuda.set_device(0)
            self.device = "cuda:0"
        else:
            self.device = "cpu"
            torch.set_num_threads(max(1, int(os.environ.get("DLLM_SHARD_THREADS", "1"))))
        self.args = runner_args.model_copy(update={"device": self.device})

    def rendezvous_address(self) -> str:
        """tcp://<node ip>:<free port> (127.0.0.1 when everything is on one node)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def start(self, rendezvous: str | None, collective_timeout_s: float) -> bool:
        tp = TPGroup()
        if self.world_size > 1:
            disable_multicast()   # before NCCL, NVSHMEM or symmetric memory start: no NVLS, ever
            backend = "nccl" if self.device.startswith("cuda") else "gloo"
            torch.distributed.init_process_group(
                backend, init_method=rendezvous, rank=self.rank, world_size=self.world_size,
                timeout=datetime.timedelta(seconds=collective_timeout_s))
            tp = TPGroup.from_default_group(self.device)
        self.runner = Runner.from_checkpoint(self.args, tp)
        return True

    def warm_up(self) -> dict:
        """Captures the CUDA graphs and compiles the steps' updates before serving (Runner.warm_up), not in
        a served command. Its steps run collectives, so every rank is started first (RayShards.start)."""
        return self.runner.warm_up()

    def execute(self, cmd: Command) -> Events | None:
        events = self.runner.execute(cmd)
        return events if self.rank == 0 else None

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return self.rank

    @ray.method(concurrency_group="health")
    def pid(self) -> int:
        return os.getpid()
