"""The in-process engine: the coordinator's step loop with the shards in this process (TP=1) or in
local processes (TP>1). Used by tests and by `python -m workers.generate`.

    command = scheduler.schedule(); events = shards.execute(command); scheduler.apply(events)
"""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from model.checkpoint import Checkpoint, RunnerArgs
from model.protocol import PREFILL_CHUNK
from model.sampling.params import DecodeParams
from workers.kv_pages import KVPages
from workers.request import Request, RequestOutput
from workers.scheduler import Scheduler
from workers.shard_group import InProcessShards, ProcessShards


class Engine:
    def __init__(self, model_dir: str, *, tp: int = 1, num_slots: int = 8, max_model_len: int = 1024,
                 max_queue: int = 256, max_steps_per_command: int = 8, dtype: str | None = None,
                 device: str = "cpu", seed: int = 0, load_format: str = "safetensors", batch_invariant: bool = False,
                 kv_cache_tokens: int | None = None, enable_prefix_caching: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK, gpu_memory_utilization: float | None = None):
        """kv_cache_tokens None: on CUDA with gpu_memory_utilization given, what that leaves; otherwise
        every slot's max_model_len and a canvas (an engine beside others in a test process takes no more)."""
        self.checkpoint = Checkpoint.read(model_dir)
        if kv_cache_tokens is None and gpu_memory_utilization is None:
            kv_cache_tokens = num_slots * (max_model_len + self.checkpoint.config.canvas_length)
        args = RunnerArgs(checkpoint=self.checkpoint, num_slots=num_slots, max_model_len=max_model_len, dtype=dtype,
                          device=device, load_format=load_format, max_steps_per_command=max_steps_per_command,
                          batch_invariant=batch_invariant, kv_cache_tokens=kv_cache_tokens,
                          gpu_memory_utilization=gpu_memory_utilization or 0.9, prefill_chunk=prefill_chunk)
        self.shards = InProcessShards(args) if tp == 1 else ProcessShards(args, tp)
        cfg = self.config = self.checkpoint.config
        # no short commands for bursts (workers/scheduler.py): a caller adds its requests before it steps
        pages = KVPages.from_report(self.shards.pool, self.checkpoint.cache_salt(dtype), enable_prefix_caching)
        self.scheduler = Scheduler(num_slots, max_queue, cfg.eos_token_ids, max_model_len, cfg.canvas_length,
                                   max_steps_per_command, seed, self.checkpoint.budget,
                                   admission_steps=max_steps_per_command, pages=pages, prefill_chunk=prefill_chunk)
        self._ids = itertools.count()

    def add(self, prompt: Sequence[int], params: DecodeParams, request_id: str | None = None) -> Request:
        self.checkpoint.family.check(params)
        return self.scheduler.add(request_id or f"req-{next(self._ids)}", prompt, params)

    def step(self) -> list[RequestOutput]:
        command = self.scheduler.schedule()
        if command is None:
            return []
        return self.scheduler.apply(self.shards.execute(command))

    def run(self, requests: list[Request], timeout_s: float = 600.0) -> list[Request]:
        deadline = time.monotonic() + timeout_s
        while not all(r.finished for r in requests):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests not finished within {timeout_s} s")
            self.step()
        return requests

    def generate(self, prompts: Sequence[Sequence[int]], params: DecodeParams | Sequence[DecodeParams]
                 ) -> list[Request]:
        if isinstance(params, DecodeParams):
            params = [params] * len(prompts)
        return self.run([self.add(p, q) for p, q in zip(prompts, params)])

    def close(self) -> None:
        self.shards.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
