"""The engine's requests as the served path sees them: joined from the RequestOutputs that
`Scheduler.apply` hands out (what the coordinator streams to the ingress), since the scheduler's own
Request records keep the tokens but no scores.

    served.generate(engine, prompts, params) -> [Served]   # Engine.generate, read from the outputs
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

from model.sampling.params import DecodeParams
from workers.engine import Engine
from workers.request import Request, RequestOutput


@dataclass
class Served:
    """One request's outputs joined as the ingress joins them (the scores None when it asked for none),
    with the request's parameters and seed."""
    request_id: str
    params: DecodeParams
    seed: int
    output: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    finish_reason: str | None
    denoising_steps: int   # the request's totals, as its last output reports them
    canvases: int
    drafts: list           # the CanvasDrafts it was sent, in order (stream_drafts)

    @classmethod
    def of(cls, request: Request, outputs: list[RequestOutput]) -> "Served":
        assert outputs and outputs[-1].finished, "a finished request's outputs"

        def joined(name: str):
            parts = [getattr(out, name) for out in outputs]
            assert all(p is None for p in parts) or all(p is not None for p in parts), name
            return None if parts[0] is None else [x for p in parts for x in p]

        last = outputs[-1]
        return cls(request.request_id, request.params, request.seed, joined("new_tokens"), joined("new_logprobs"),
                   joined("new_ranks"), joined("new_top_ids"), joined("new_top_logprobs"), last.finish_reason,
                   last.denoising_steps, last.canvases, [d for out in outputs for d in out.new_drafts])


def generate(engine: Engine, prompts: Sequence[Sequence[int]], params: DecodeParams | Sequence[DecodeParams],
             timeout_s: float = 600.0) -> list[Served]:
    """Engine.generate, each request read from the outputs it was sent."""
    if isinstance(params, DecodeParams):
        params = [params] * len(prompts)
    requests = [engine.add(p, q) for p, q in zip(prompts, params)]
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in requests):
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests not finished within {timeout_s} s")
        for out in engine.step():
            outputs[out.request_id].append(out)
    served = [Served.of(r, outputs[r.request_id]) for r in requests]
    for r, s in zip(requests, served):   # the stream and the scheduler's record tell one story
        assert (s.output, s.finish_reason, s.denoising_steps, s.canvases) == (
            r.output, r.finish_reason, r.denoising_steps, r.canvases), r.request_id
    return served


def generate_shuffled(engine: Engine, batch: list[tuple[list[int], DecodeParams]],
                      rng: random.Random) -> dict[tuple[int, ...], Served]:
    """The (prompt, params) pairs shuffled by `rng` into one batch: each answer by its prompt."""
    rng.shuffle(batch)
    done = generate(engine, [p for p, _ in batch], [q for _, q in batch])
    return {tuple(p): r for (p, _), r in zip(batch, done)}


def assert_same_answer(got: Served, alone: Served, tol: float = 1e-4) -> None:
    """A request in a batch gave what it gives alone: its tokens, and its scores where it asked for them."""
    assert got.output == alone.output, got.params
    if alone.logprobs is not None:
        assert len(got.logprobs) == len(got.output)
        assert max(abs(x - y) for x, y in zip(got.logprobs, alone.logprobs)) < tol
        assert got.ranks == alone.ranks and got.top_ids == alone.top_ids
