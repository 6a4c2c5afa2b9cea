"""A request's choices (`n`, a list of prompts): each one its own engine request (its own slot), with its
own seed, and what the ingress needs to run them together and end them together.

Choice j of a prompt (j = 0 .. n-1; its response `index` is prompt_index * n + j, OpenAI's rule) gets
`choice_seed(seed, j)`: the request's seed itself for j = 0 (so n = 1 answers as before, and choice 0
of any n equals the request sent with n = 1), and for j > 0 the first 8 bytes of
blake2b("<seed>/<j>"), big-endian, with the top bit cleared (a seed in [0, 2^63)). The same request
then gives the same choices, distinct ones for distinct j, and choice j equals the request sent alone
with n = 1 and seed choice_seed(seed, j). Every prompt of a list uses the same seeds, so a list answers
as its prompts sent one by one. A request without a seed: at temperature 0 the base seed is the
scheduler's fixed TEMPERATURE_0_SEED (reproducible: DiffusionGemma draws its canvases' noise from it),
above 0 each choice draws its own.

`gathered` and `merged` run the choices' coroutines or streams concurrently; the first to fail cancels
the rest (a choice's stream cancelled cancels its engine request), and so does the caller going away.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id

from deployments.output import OutputAssembler
from model.sampling.params import DecodeParams
from workers.request import RequestOutput
from workers.scheduler import TEMPERATURE_0_SEED

T = TypeVar("T")


def own_call(call: Callable[[], T]) -> T:
    """Make one handle call of a request's choices under its own internal request id. Serve gives every
    call made while answering a request the request's internal id, and its router indexes the calls it
    is placing by that id: of several placed at once, only one is indexed, and the others are never
    placed when a request router is configured (ours, workers/prefix_router.py). The request id the
    logs show stays the request's."""
    def fresh() -> T:
        ctx = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))
        return call()
    return contextvars.copy_context().run(fresh)


@dataclass
class Choice:
    """One choice of a response: its engine request's stream and what its answer needs."""

    index: int                         # in the response: prompt_index * n + j
    prompt: list[int]
    prompt_param: str                  # the request's name for its prompt, as errors name it
    params: DecodeParams
    assembler: OutputAssembler
    stream: Any = None                 # the coordinator's response stream (a Serve DeploymentResponseGenerator)
    tokens: int = 0                    # output tokens sent so far
    last: RequestOutput | None = None  # its latest output (usage: the request's totals)


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of a prompt whose request gave (or was given) `seed`."""
    if j == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def choice_params(params: DecodeParams, n: int) -> list[DecodeParams]:
    """The n choices' parameters: `params` with each choice's seed (unset: drawn by the scheduler)."""
    base = params.seed
    if base is None and params.effective_temperature == 0:
        base = TEMPERATURE_0_SEED
    if base is None:
        return [params] * n
    return [params.model_copy(update={"seed": choice_seed(base, j)}) for j in range(n)]


async def gathered(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Every coroutine's result, in order; the first exception cancels the others and is raised (once
    they have ended), as is a cancellation of the caller."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        await _cancel(tasks)


async def merged(sources: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The sources' items as they come; the first exception cancels the other sources and is raised, and
    closing this iterator (the client went away) cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((True, item))
        except Exception as err:   # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((False, err))
            return
        queue.put_nowait((False, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            is_item, value = await queue.get()
            if is_item:
                yield value
            elif value is None:
                left -= 1
            else:
                raise value
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
