"""The ingress's FastAPI app served in this process, for tests about what the app answers rather than about
Serve and HTTP: the real OpenAIIngress (gate, validation, tokenizing, defaults, answers) over the real
Coordinator, whose one shard is an in-process runner behind a one-thread executor (as calls queue at a Ray
actor). Serve's part is stood in for: the replica context that hands the endpoints their ingress, and the
DeploymentHandle calls the ingress makes. tests/test_http*.py run the same app through Serve's proxy.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import ray.serve
from starlette.testclient import TestClient

from deployments.args import AppArgs
from deployments.ingress import OpenAIIngress, app
from model.checkpoint import Checkpoint, RunnerArgs
from workers.serve_coordinator import CoordinatorDeployment
from workers.shard_group import InProcessShards


class ThreadShards:
    """The shard group's interface (async start/execute/ping/stop) over one in-process runner."""

    def __init__(self, args: RunnerArgs):
        self.args = args
        self.pool = ThreadPoolExecutor(1)
        self.inner: InProcessShards | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.inner = await loop.run_in_executor(self.pool, InProcessShards, self.args)
        self.warm_up_report = self.inner.pool   # the KV pool the scheduler manages

    async def execute(self, cmd):
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.inner.execute, cmd)

    async def ping(self) -> None:
        pass

    def stop(self) -> None:
        pass


class _Call:
    """What `handle.method.remote(...)` gives: awaitable for a unary method, async-iterable for a
    streaming one; cancel() ends either."""

    def __init__(self, result):
        if inspect.isasyncgen(result):
            self._stream, self._task = result, None
        else:
            self._stream, self._task = None, asyncio.ensure_future(result) if inspect.isawaitable(result) else None
            self._value = result

    def __await__(self):
        if self._task is None:
            return asyncio.sleep(0, self._value).__await__()
        return self._task.__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._stream.__anext__()

    def cancel(self) -> None:
        if self._stream is not None:
            asyncio.ensure_future(self._stream.aclose())
        elif self._task is not None:
            self._task.cancel()


class LocalHandle:
    """The DeploymentHandle calls the ingress makes (`.options(stream=True)`, `.method.remote(...)`), on a
    local object."""

    def __init__(self, target):
        self._target = target

    def options(self, **_) -> "LocalHandle":
        return self

    def __getattr__(self, name: str):
        method = getattr(self._target, name)
        return types.SimpleNamespace(remote=lambda *args, **kwargs: _Call(method(*args, **kwargs)))


async def _build(model_dir: str, args: dict, checkpoint: Checkpoint):
    a = AppArgs(**args)
    runner_args = RunnerArgs(checkpoint=checkpoint, num_slots=a.max_num_seqs, max_model_len=a.max_model_len,
                             dtype=a.torch_dtype("cpu"), device="cpu", max_steps_per_command=a.max_steps_per_command,
                             kv_cache_tokens=a.kv_cache_tokens, prefill_chunk=a.prefill_chunk_tokens)
    deployment = object.__new__(CoordinatorDeployment.func_or_class)
    deployment.coordinator = _coordinator(checkpoint, ThreadShards(runner_args), a)
    await deployment.coordinator.start()
    ingress = object.__new__(OpenAIIngress.func_or_class.__mro__[1])
    await ingress.__init__(LocalHandle(deployment), {**a.model_dump(), "model": model_dir, "device": "cpu"}, checkpoint)
    ingress._watch.cancel()   # the placement watch reads Ray's placement groups: there are none here
    return ingress, deployment


def _coordinator(checkpoint: Checkpoint, shards, a: AppArgs):
    from workers.coordinator import Coordinator

    return Coordinator(checkpoint, shards, **a.engine_args(), cache_salt=checkpoint.cache_salt(a.torch_dtype("cpu")))


# Serve's replica context, one per in-process app: each app's client runs its own event loop, on which
# its endpoints and gate ask for their ingress
_contexts: dict[asyncio.AbstractEventLoop, types.SimpleNamespace] = {}
_serve_context = ray.serve.get_replica_context


def _replica_context():
    try:
        return _contexts[asyncio.get_running_loop()]
    except (RuntimeError, KeyError):   # not on an in-process app's loop: Serve's own
        return _serve_context()


async def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


@contextlib.contextmanager
def inprocess_app(model_dir, **args) -> Iterator[TestClient]:
    """A TestClient of the app serving `model_dir` with the application arguments `args`; the engine runs
    on the client's event loop, its shard on a thread."""
    checkpoint = Checkpoint.read(str(model_dir))
    ray.serve.get_replica_context = _replica_context
    with TestClient(app, raise_server_exceptions=False) as client:
        loop = client.portal.call(_loop)
        context = _contexts[loop] = types.SimpleNamespace(app_name="inprocess", servable_object=None, replica_id=None)
        deployment = None
        try:
            ingress, deployment = client.portal.call(_build, str(model_dir), {**args, "model": str(model_dir)},
                                                     checkpoint)
            context.servable_object = ingress
            yield client
        finally:
            loop_task = deployment and deployment.coordinator._loop_task
            if loop_task is not None:
                client.portal.call(_cancel, loop_task)
            del _contexts[loop]


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
