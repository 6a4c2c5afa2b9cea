"""The tensor-parallel ranks of one model instance behind one call: `execute(command) -> events`.

`InProcessShards` runs TP=1 in the caller's process. `ProcessShards` runs one OS process per rank
joined by a gloo (CPU) or NCCL process group: the same runner, the same commands, every rank in
lockstep; rank 0 answers. Ray actors (workers/shard) implement the same interface.
"""
from __future__ import annotations

import os
import queue
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from model.checkpoint import RunnerArgs
from model.parallel.group import TPGroup
from model.parallel.small_allreduce import disable_multicast
from model.protocol import Command, Events
from model.runner import Runner
from workers.failures import ShardFailure


class InProcessShards:
    def __init__(self, args: RunnerArgs):
        self.runner = Runner.from_checkpoint(args)
        self.runner.size_pool()
        self.pool = self.runner.pool   # the KV pool's groups and page size

    def execute(self, cmd: Command) -> Events:
        return self.runner.execute(cmd)

    def close(self) -> None:
        self.runner.close()


def _rank_main(rank: int, world: int, init_file: str, args: RunnerArgs, commands, answers) -> None:
    try:
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        disable_multicast()   # before NCCL, NVSHMEM or symmetric memory start: no NVLS, ever
        if backend == "nccl":
            torch.cuda.set_device(rank)   # symmetric memory maps its buffers on the current device
        torch.distributed.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                             world_size=world)
        torch.set_num_threads(1)
        runner = Runner.from_checkpoint(args.model_copy(update={"device": device}), TPGroup.from_default_group(device))
        runner.size_pool()
        answers.put(("ready", runner.pool))
        while True:
            cmd = commands.get()
            if cmd is None:
                break
            events = runner.execute(cmd)
            if rank == 0:
                answers.put(("events", events))
    except Exception:  # the parent turns this into ShardFailure; a rank must never die silently
        answers.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class ProcessShards:
    def __init__(self, args: RunnerArgs, tp: int, timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self._dir = tempfile.mkdtemp(prefix="dllm-tp-")
        init_file = str(Path(self._dir) / "rendezvous")
        self.commands = [ctx.Queue() for _ in range(tp)]
        self.answers = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, tp, init_file, args, self.commands[r], self.answers),
                                  daemon=True) for r in range(tp)]
        for p in self.procs:
            p.start()
        self.pool = [self._answer("ready") for _ in range(tp)][0]   # every rank's pool is alike

    def _answer(self, kind: str):
        try:
            got, payload = self.answers.get(timeout=self.timeout_s)
        except queue.Empty:
            self.close()
            raise ShardFailure(f"no answer from the shards within {self.timeout_s} s") from None
        if got == "error":
            self.close()
            raise ShardFailure(payload)
        assert got == kind, (got, kind)
        return payload

    def execute(self, cmd: Command) -> Events:
        for q in self.commands:
            q.put(cmd)
        return self._answer("events")

    def close(self) -> None:
        for q, p in zip(self.commands, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        try:
            os.remove(Path(self._dir) / "rendezvous")
        except OSError:
            pass
