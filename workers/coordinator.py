"""Coordinator: one model instance (one Serve replica): its shards, its scheduler and its step loop.

    command = scheduler.schedule(); events = await shards.execute(command); scheduler.apply(events)

The loop is an asyncio task on the replica's event loop and never blocks it. With `overlap_commands` a
second command waits at the shards behind the running one, so they never idle through a round trip.
`generate` streams a request's blocks as they commit; a caller that goes away frees its slot at the next
step boundary. A shard failure ends every in-flight request with an error saying so and the shard group
is rebuilt; if it cannot be, the health check fails and Serve replaces the replica (docs/design.md).
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
from collections import deque
from typing import AsyncIterator

from model.checkpoint import Checkpoint
from model.protocol import PREFILL_CHUNK, StepCounters
from model.sampling.params import DecodeParams, ParamError
from workers.failures import ShardFailure
from workers.kv_pages import KVPages
from workers.metrics import RequestMetrics
from workers.request import RequestOutput
from workers.scheduler import ADMISSION_STEPS, QueueFull, Scheduler, derived_metrics

log = logging.getLogger("dllm.coordinator")


class RequestError(Exception):
    """Ends a stream: `kind` maps to an HTTP status at the ingress; `param` names the request's field at
    fault, where one is (a ParamError's)."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


class GraphCounts:
    """Steps run outside a CUDA graph and graphs captured since the shards were ready (model/graphs.py),
    summed over shard groups: each command's events carry rank 0's counts so far, and a rebuilt group
    starts from 0."""

    def __init__(self):
        self.current = {"eager_steps": 0, "captured_after_ready": 0, "kernel_compiles": 0}
        self.retired = dict(self.current)

    def update(self, counts: dict | None) -> None:
        if counts:
            self.current = {k: counts[k] for k in self.current}

    def retire(self) -> None:
        self.retired = self.totals()
        self.current = dict.fromkeys(self.current, 0)

    def totals(self) -> dict:
        return {k: self.retired[k] + self.current[k] for k in self.current}


def describe_warm_up(report: dict) -> str:
    """One line of what a shard's warm-up did (the ready line of the log and of scripts/serve_local.py)."""
    graphs = report.get("graphs") or {}
    kinds = ", ".join(f"{kind} {n}" for kind, n in graphs.items())
    seconds, longest = report.get("seconds_by_kind") or {}, report.get("longest_by_kind") or {}
    split = "; ".join(f"{kind} {seconds[kind]:.1f} s, the longest {longest.get(kind, 0):.1f}" for kind in seconds)
    return (f"{sum(graphs.values())} CUDA graphs ({kinds}; batch sizes {report.get('capture_sizes')}, "
            f"{len(report.get('key_buckets') or [])} key buckets) captured in {report.get('seconds', 0):.1f} s"
            + (f" ({split})" if split else "") + f", holding {report.get('graph_bytes', 0) / 2**30:.2f} GiB")


class Coordinator:
    """Not a Serve deployment by itself: deployments/app wraps it (workers never import Serve's HTTP
    side). `shards` is anything with async start/execute/ping/stop (RayShards in production)."""

    def __init__(self, checkpoint: Checkpoint, shards, *, num_slots: int, max_model_len: int, max_queue: int,
                 max_steps_per_command: int, seed: int = 0, request_timeout_s: float = 600.0,
                 overlap_commands: bool = True, admission_steps: int = ADMISSION_STEPS,
                 enable_prefix_caching: bool = True, cache_salt: bytes = b"", prefill_chunk: int = PREFILL_CHUNK):
        self.checkpoint = checkpoint
        self.config = self.checkpoint.config
        self.budget = self.checkpoint.budget   # what the shards' runners bound steps by
        self.shards = shards
        self.num_slots, self.max_model_len, self.max_queue = num_slots, max_model_len, max_queue
        self.max_steps_per_command, self.seed = max_steps_per_command, seed
        self.request_timeout_s = request_timeout_s
        self.commands_in_flight = 2 if overlap_commands else 1
        self.admission_steps = admission_steps
        self.prefix_caching, self.cache_salt = enable_prefix_caching, cache_salt
        self.prefill_chunk = prefill_chunk
        self.shard_busy_s = 0.0   # the runners' execute time (rank 0), summed over commands
        self.warm_up: dict = {}        # rank 0's last warm-up report (model.runner.Runner.warm_up)
        self.scheduler = self._new_scheduler()
        self.streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._started = False
        self._healthy = True
        # what /health reports: "starting" (loading weights, capturing graphs), "ready", "rebuilding"
        # (after a shard failure), "down" (a start or a rebuild failed)
        self.state = "starting"
        self.graphs = GraphCounts()    # steps outside CUDA graphs and captures while serving, from the events
        self.failures = 0
        self.shard_starts = 0
        self.metrics = RequestMetrics()
        self._retired = StepCounters()  # counters of schedulers replaced after a failure
        self._retired_cache = [0, 0]    # their prefix caches' queries and hits
        self.started_at = time.monotonic()

    def _new_scheduler(self) -> Scheduler:
        """A scheduler with an empty KV cache over the pool the shards reported (none before they start)."""
        pages = KVPages.from_report(self.warm_up, self.cache_salt, self.prefix_caching) \
            if "kv_groups" in self.warm_up else None
        return Scheduler(self.num_slots, self.max_queue, self.config.eos_token_ids, self.max_model_len,
                         self.config.canvas_length, self.max_steps_per_command, self.seed, self.budget,
                         self.admission_steps, pages, self.prefill_chunk)

    async def start(self) -> None:
        """Starts the shards (once; a request arriving during a start or a rebuild waits for it) and
        the step loop."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._started:
                try:
                    await self._start_shards()
                except ShardFailure as err:
                    self._healthy, self.state = False, "down"
                    raise RequestError("shard_failure", f"the model shards could not start: {err}") from None
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            # A fresh context: the loop belongs to no request. Inheriting the starting request's context
            # would make Ray count every shard call of the loop as that request's child, and cancelling
            # the request (a client hanging up) would cancel them, ending the loop.
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], params: DecodeParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs until one is finished. The first one, with no tokens, says the request
        was admitted to the queue; raises RequestError ("queue_full", "invalid", "shard_failure",
        "timeout")."""
        await self.start()  # the first request starts the shards
        request_id = request_id or f"cmpl-{next(self._ids)}"
        try:
            self.checkpoint.family.check(params)
            self.scheduler.add(request_id, prompt, params)
        except QueueFull:
            raise RequestError("queue_full", f"the request queue is full ({self.max_queue} waiting)") from None
        except ValueError as err:
            raise RequestError("invalid", str(err), err.param if isinstance(err, ParamError) else None) from None
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        self._wake.set()
        finished = False
        deadline = time.monotonic() + self.request_timeout_s
        try:
            yield RequestOutput(request_id)
            while not finished:
                remaining = deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(queue.get(), max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise RequestError("timeout", f"request not finished within {self.request_timeout_s} s") from None
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self.streams.pop(request_id, None)
            if not finished:  # the caller went away: free the slot at the next step boundary
                aborted = self.scheduler.cancel(request_id)
                if aborted is not None:
                    self.metrics.observe(aborted)
                self._wake.set()

    # ---- the step loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        in_flight: deque[asyncio.Task] = deque()   # shard calls, in the order their commands were made
        try:
            while True:
                while len(in_flight) < self.commands_in_flight:
                    command = self.scheduler.schedule(ahead=bool(in_flight))
                    if command is None:
                        break
                    # a task starts its shard call before the loop's next await: calls reach the shards in order
                    in_flight.append(asyncio.ensure_future(self.shards.execute(command)))
                if not in_flight:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if len(in_flight) < self.commands_in_flight:   # a request arriving now can be queued behind
                    self._wake.clear()
                    wake = asyncio.ensure_future(self._wake.wait())
                    await asyncio.wait((in_flight[0], wake), return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
                    if not in_flight[0].done():
                        continue
                try:
                    events = await in_flight.popleft()
                    self.shard_busy_s += events.execute_s
                    self.graphs.update(events.graphs)
                    outputs = self.scheduler.apply(events)
                except Exception as err:   # a shard failed, or a bug here: end the requests, never strand them
                    await self._drop(in_flight)
                    if not isinstance(err, ShardFailure):
                        log.exception("the step loop failed")
                        err = ShardFailure(f"internal error: {type(err).__name__}: {err}")
                    await self._recover(err)
                    continue
                for out in outputs:
                    self.metrics.observe(out)
                    queue = self.streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                await asyncio.sleep(0)  # let streams and new requests in between commands
        finally:   # the loop cancelled (the replica shutting down): no shard call outlives it
            for call in in_flight:
                call.cancel()

    @staticmethod
    async def _drop(calls: deque[asyncio.Task]) -> None:
        """Cancels the shard calls still in flight (their commands belong to a scheduler being replaced)."""
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        calls.clear()

    async def _recover(self, err: ShardFailure) -> None:
        """Ends every in-flight request with the failure, then rebuilds the shard group."""
        self.failures += 1
        log.error("shard failure, rebuilding the shard group: %s", err)
        failure = RequestError("shard_failure", f"model shard failed: {err}")
        for queue in self.streams.values():
            queue.put_nowait(failure)
        self._retire_scheduler()
        self.graphs.retire()
        async with self._lock:
            self.shards.stop()
            self._started, self.state = False, "rebuilding"
            try:
                await self._start_shards()
            except ShardFailure as again:
                log.error("could not rebuild the shard group: %s", again)
                self._healthy, self.state = False, "down"

    def _retire_scheduler(self) -> None:
        """A new scheduler with an empty KV cache; the old one's counters kept in the totals."""
        self._retired.add(self.scheduler.counters)
        pages = self.scheduler.pages
        if pages is not None:
            self._retired_cache = [self._retired_cache[0] + pages.queries, self._retired_cache[1] + pages.hits]
        self.scheduler = self._new_scheduler()

    async def _start_shards(self) -> None:
        self.shard_starts += 1
        await self.shards.start()
        self.warm_up = getattr(self.shards, "warm_up_report", None) or {}
        assert not self.scheduler.has_work(), "shards start with no request in the scheduler"
        self._retire_scheduler()   # a scheduler over the pool the shards hold, its cache empty
        self._started, self._healthy, self.state = True, True, "ready"
        if self.warm_up.get("graphs"):
            log.info("ready: %s", describe_warm_up(self.warm_up))

    # ---- operations -----------------------------------------------------------------------------
    async def check_health(self) -> None:
        if not self._healthy:
            raise RuntimeError("the shard group is down and could not be rebuilt")
        if self._started:
            await self.shards.ping()

    def stats(self) -> dict:
        s = self.scheduler
        counters = StepCounters()
        counters.add(self._retired)
        counters.add(s.counters)
        wall = time.monotonic() - self.started_at
        pages = s.pages
        cache = {"kv_cache_usage": pages.usage if pages else 0.0,
                 "kv_cache_tokens": pages.capacity_tokens if pages else 0,
                 "prefix_cache_queries": self._retired_cache[0] + (pages.queries if pages else 0),
                 "prefix_cache_hits": self._retired_cache[1] + (pages.hits if pages else 0)}
        return {"state": self.state, "running": s.num_running, "waiting": s.num_waiting, "free_slots": s.free_slots,
                **cache,
                "num_slots": self.num_slots, "shard_failures": self.failures, "warm_up": self.warm_up,
                "graphs": self.graphs.totals(),
                "shard_restarts": max(self.shard_starts - 1, 0), **self.metrics.snapshot(),
                "shard_pids": list(getattr(self.shards, "pids", [])), "shard_busy_s": self.shard_busy_s,
                "counters": vars(counters).copy(), "derived": derived_metrics(counters, wall)}
