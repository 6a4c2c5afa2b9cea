"""One generation request's host-side state, and what one `Scheduler.apply` reports for it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from model.protocol import Block, Draft
from model.sampling.params import DecodeParams


@dataclass
class CanvasDraft:
    """A draft (model/drafts.py) as its request sees it: the canvas placed in the output."""
    offset: int            # the output index of the canvas's first position
    step: int              # denoising steps of the canvas so far
    tokens: list[int]      # the canvas (masked diffusion: the mask token where masked)
    known: list[bool]      # revealed (masked diffusion) or accepted at that step (DiffusionGemma)
    revealed: list[int]    # positions known now that were not at the request's previous draft of this canvas


@dataclass
class RequestOutput:
    request_id: str
    new_tokens: list[int] = field(default_factory=list)
    # Lists (one entry per new token) when the request asked for logprobs, else None.
    new_logprobs: list[float] | None = None
    new_ranks: list[int] | None = None
    new_top_ids: list[list[int]] | None = None
    new_top_logprobs: list[list[float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    denoising_steps: int = 0   # the request's totals so far (usage statistics)
    canvases: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0     # its prompt's tokens the prefix cache served
    new_drafts: list[CanvasDraft] = field(default_factory=list)
    # latencies this output completes (seconds): TTFT with the first tokens, the gap before later blocks,
    # end to end with the finish
    ttft_s: float | None = None
    inter_block_s: float | None = None
    e2e_s: float | None = None


@dataclass
class Request:
    request_id: str
    prompt: tuple[int, ...]
    params: DecodeParams
    seed: int
    stop_ids: frozenset[int] = frozenset()   # EOS (unless ignore_eos) and stop_token_ids: kept, then stop
    output: list[int] = field(default_factory=list)   # the tokens (their scores go out with each output only)
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    slot: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    block_times: list[float] = field(default_factory=list)   # when each block with tokens arrived
    finish_time: float | None = None
    denoising_steps: int = 0
    canvases: int = 0
    last_draft: CanvasDraft | None = None
    steps_left: int | None = None            # bound on the steps its slot can still run (model/phases.py)
    cached_tokens: int = 0                   # its prompt's tokens whose KV the prefix cache served
    prefilled: int = 0                       # its prompt's positions whose prefill is scheduled (chunks)
    page_addresses: list[bytes] | None = None   # its prompt's full pages' cache addresses, hashed as it came

    @property
    def latencies(self) -> dict[str, float | list[float] | None]:
        """docs/spec.md section 8, per request: time to first token, inter-token latency per streamed block
        (the gap before each block after the first), end-to-end latency; seconds."""
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        e2e = None if self.finish_time is None else self.finish_time - self.arrival_time
        itl = [b - a for a, b in zip(self.block_times, self.block_times[1:])]
        return {"ttft_s": ttft, "inter_block_s": itl, "e2e_s": e2e}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str) -> RequestOutput:
        """Marks it finished; the output carries no new tokens (what a cancel reports)."""
        assert not self.finished, self.request_id
        self.finish_reason = reason
        self.finish_time = time.monotonic()
        self.slot = None
        return self._output([], [], [], [], [])

    def extend(self, block: Block) -> RequestOutput:
        """Appends a block's tokens up to the first stop id (kept) and within max_tokens (docs/spec.md 3, last
        paragraph); tokens past the cut are dropped together with their scores."""
        assert not self.finished, self.request_id
        tokens = block.tokens[: self.params.max_tokens - len(self.output)]
        reason = None
        for i, t in enumerate(tokens):
            if t in self.stop_ids:
                tokens, reason = tokens[: i + 1], "stop"
                break
        n = len(tokens)
        if reason is None and len(self.output) + n == self.params.max_tokens:
            reason = "length"
        self.output += tokens
        self.denoising_steps += block.denoising_steps
        self.canvases += block.canvases
        ttft = gap = None
        if n:
            now = time.monotonic()
            if self.block_times:
                gap = now - self.block_times[-1]
            else:
                self.first_token_time = now
                ttft = now - self.arrival_time
            self.block_times.append(now)
        # a draft of a canvas past the end (a host-side stop) is of no use to the request
        drafts = [self._draft(d) for d in block.drafts or ()
                  if reason is None or d.start - len(self.prompt) < len(self.output)]
        scores = ([], [], [], [])
        k = self.params.logprobs
        if k is not None and block.tokens:  # the runner sends no scores with an empty block
            assert block.logprobs is not None and block.ranks is not None, f"slot {block.slot}: scores missing"
            assert k == 0 or (block.top_ids is not None and block.top_logprobs is not None), block.slot
            # logprobs=0 asks for the sampled token's score only: the runner may omit alternatives.
            none = [[] for _ in block.tokens]
            top_ids = none if block.top_ids is None else block.top_ids
            top_lps = none if block.top_logprobs is None else block.top_logprobs
            assert len(block.logprobs) == len(block.ranks) == len(top_ids) == len(top_lps) == len(block.tokens)
            scores = (block.logprobs[:n], block.ranks[:n], top_ids[:n], top_lps[:n])
        if reason is not None:
            self.finish(reason)
        out = self._output(tokens, *scores)
        out.new_drafts, out.ttft_s, out.inter_block_s = drafts, ttft, gap
        return out

    def _draft(self, d: Draft) -> CanvasDraft:
        offset, prev = d.start - len(self.prompt), self.last_draft
        before = prev.known if prev is not None and prev.offset == offset else [False] * len(d.known)
        revealed = [j for j, (now, then) in enumerate(zip(d.known, before)) if now and not then]
        self.last_draft = CanvasDraft(offset, d.step, d.tokens, d.known, revealed)
        return self.last_draft

    def _output(self, tokens, logprobs, ranks, top_ids, top_logprobs) -> RequestOutput:
        asked = self.params.logprobs is not None
        return RequestOutput(
            self.request_id, list(tokens),
            list(logprobs) if asked else None, list(ranks) if asked else None,
            list(top_ids) if asked else None, list(top_logprobs) if asked else None,
            self.finished, self.finish_reason, self.denoising_steps, self.canvases, len(self.output),
            self.cached_tokens, e2e_s=self.finish_time - self.arrival_time if self.finished else None)
