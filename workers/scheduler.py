"""Admission, slots and the end of requests: pure python (no torch, no ray).

    command = scheduler.schedule(); events = shards.execute(command); scheduler.apply(events)

A command runs at most max_steps_per_command steps, fewer when its slots surely need fewer (their
steps_left bounds, model/phases.py). schedule() may run ahead of apply() (the coordinator keeps the next
command queued at the shards); blocks for a slot from commands scheduled before its current request was
admitted belong to the previous occupant and are ignored. While a burst of requests may be arriving,
commands are short (`admission_steps`), so a burst's later requests share its first one's passes. The
rules and why: docs/design.md, "The step loop".
"""
from __future__ import annotations

import math
import random
from collections import deque
from typing import Sequence

from model.kv_budget import canvas_growth
from model.phases import StepBudget
from model.protocol import COMMANDS_AHEAD, PREFILL_CHUNK, Command, Events, NewSlot, PageRun, PrefillRun, StepCounters
from model.sampling.params import DecodeParams, ParamError
from workers.kv_pages import KVPages
from workers.request import Request, RequestOutput


# The seed of a request at temperature 0 that gives none, so that its output never depends on when it came
# or what ran before it: masked diffusion draws no noise at temperature 0 anyway, while DiffusionGemma's
# canvases start as uniform noise and are renoised at any temperature, and this makes that noise the same
# every time (docs/spec.md section 9).
TEMPERATURE_0_SEED = 0
# A short command's steps while a burst of requests may be arriving (docs/design.md): the rest of a
# burst then starts at most 2 x 2 steps behind its first request, against 2 x max_steps_per_command.
ADMISSION_STEPS = 2


class QueueFull(Exception):
    """The bounded waiting queue is full; the caller should retry later (HTTP 429/503, Retry-After)."""


class Scheduler:
    def __init__(self, num_slots: int, max_queue: int, eos_token_ids: Sequence[int], max_model_len: int,
                 canvas_length: int, max_steps_per_command: int = 8, seed: int = 0,
                 budget: StepBudget | None = None, admission_steps: int = ADMISSION_STEPS,
                 pages: KVPages | None = None, prefill_chunk: int = PREFILL_CHUNK):
        """budget: the runner's step bounds for admitted requests; None sizes every command at
        max_steps_per_command until the runner's events report bounds. admission_steps: the most steps
        of a command while a burst of requests may be arriving (above). pages: the KV pool's pages, which
        admission goes by and commands set the shards' page tables from (None: every slot has its own
        pages for max_model_len positions). prefill_chunk: the most prompt positions a command prefills (a
        longer prompt is prefilled a chunk a command, between the running requests' steps)."""
        for name, value, least in (("num_slots", num_slots, 1), ("max_queue", max_queue, 0),
                                   ("max_model_len", max_model_len, 1), ("canvas_length", canvas_length, 1),
                                   ("max_steps_per_command", max_steps_per_command, 1),
                                   ("admission_steps", admission_steps, 1)):
            if value < least:
                raise ValueError(f"{name}={value} must be >= {least}")
        self.num_slots = num_slots
        self.max_queue = max_queue
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.canvas_length = canvas_length
        self.max_steps_per_command = max_steps_per_command
        self.admission_steps = admission_steps
        self.budget = budget
        self.pages = pages
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        self.prefill_chunk = prefill_chunk
        self.counters = StepCounters()   # totals since start (docs/spec.md section 8)
        self._rng = random.Random(seed)
        self._slots: list[Request | None] = [None] * num_slots
        self._admitted_by = [0] * num_slots   # sequence number of the command that admitted the occupant
        self._waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}    # waiting or running
        self._release: list[int] = []          # slots to free in the next command
        self._scheduled = 0                    # commands handed out
        self._applied = 0                      # events applied
        # of each command handed out and not yet applied: its steps, and whether it was a short one that
        # admitted requests (a burst's first)
        self._in_flight: deque[tuple[int, bool]] = deque()
        self._held_back = False   # the last command was a prefill alone while other rows were decoding

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_slots(self) -> int:
        """Slots no request holds (those still to be released count: the next command frees them first)."""
        return self.num_slots - self.num_running

    def has_work(self) -> bool:
        return bool(self._waiting or self._release or self.num_running)

    def add(self, request_id: str, prompt: Sequence[int], params: DecodeParams) -> Request:
        """Queues a request (FIFO). `max_queue` bounds the requests that must wait for a slot: those that
        free slots take at the next schedule() do not count against it. Raises ParamError naming what does
        not fit, QueueFull when the queue is full."""
        prompt = tuple(prompt)
        if not prompt:
            raise ParamError(f"request {request_id!r}: the prompt is empty", "prompt")
        if request_id in self._live:
            raise ParamError(f"request_id {request_id!r} is already in use", "request_id")
        # Diffusion and linear speculation write whole canvases, so the last one may run past max_tokens.
        positions = params.max_tokens if params.mode == "ar" else \
            math.ceil(params.max_tokens / self.canvas_length) * self.canvas_length
        if len(prompt) + positions > self.max_model_len:
            raise ParamError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} "
                f"({positions} positions in {params.mode} mode, canvas_length={self.canvas_length}) "
                f"exceeds max_model_len={self.max_model_len}", "max_tokens")
        if self.pages is not None and not self.pages.fits_ever(self._kv_positions(len(prompt), params),
                                                               self._ahead(len(prompt), params)):
            raise ParamError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} needs "
                f"more KV cache than this server holds ({self.pages.capacity_tokens} positions: its kv_cache_tokens, "
                "or what gpu_memory_utilization leaves)", "max_tokens")
        if len(self._waiting) - self.free_slots >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests waiting (max_queue={self.max_queue})")
        if params.seed is not None:
            seed = params.seed
        else:
            seed = TEMPERATURE_0_SEED if params.effective_temperature == 0 else self._rng.randrange(2**63)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request = Request(request_id, prompt, params, seed, stop_ids)
        if self.pages is not None:   # hashed once as it comes: admission only looks the addresses up
            request.page_addresses = self.pages.addresses(prompt)
        self._waiting.append(request)
        self._live[request_id] = request
        return request

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Finishes a waiting or running request with "abort"; None if it is finished or unknown."""
        request = self._live.get(request_id)
        if request is None:
            return None
        if request.slot is None:
            self._waiting.remove(request)
            del self._live[request_id]
        else:
            self._vacate(request.slot)
        return request.finish("abort")

    # ---- KV pages ---------------------------------------------------------------------------------
    def _kv_positions(self, prompt_len: int, params: DecodeParams) -> int:
        """The positions a request can write KV at: its prompt and outputs, and in canvas modes one canvas
        of scratch past them (a denoise step's, or a verify's)."""
        if params.mode == "ar":
            return prompt_len + params.max_tokens
        return prompt_len + math.ceil(params.max_tokens / self.canvas_length) * self.canvas_length + self.canvas_length

    def _growth(self, params: DecodeParams, steps: int) -> int:
        """How far past its known length `steps` steps of a request write: an AR step one position; a
        canvas at most one commit every other step, and a canvas of scratch past it."""
        if params.mode == "ar":
            return steps + 1
        return canvas_growth(steps, self.canvas_length)

    def _ahead(self, prompt_len: int, params: DecodeParams) -> int:
        """How far a request's page tables can run past its known length: a prompt chunk (a command's
        prefill writes it at once), then the commands in flight and the next."""
        return min(prompt_len, self.prefill_chunk) + self._growth(params, COMMANDS_AHEAD * self.max_steps_per_command)

    def _page_runs(self, chunks: dict[str, tuple[int, int]], running: list[Request], steps: int
                   ) -> tuple[PageRun, ...]:
        """The page table entries this command's steps need: a request prefilling a chunk, its chunk (and
        what its first steps write, if the chunk ends its prompt); every other request, what the commands
        in flight and this one can write. Sliding windows let go behind what is known of each length."""
        later = sum(s for s, _ in self._in_flight) + steps
        runs = []
        for request in running:
            rid, params, n = request.request_id, request.params, len(request.prompt)
            if rid in chunks:
                known, end = chunks[rid]
                if end == n:
                    end += self._growth(params, steps)
            elif request.prefilled < n:   # waits for a later command's chunk
                continue
            else:
                known = n + max(len(request.output) - 1, 0)   # at most the device's length
                end = known + 1 + self._growth(params, later)
            self.pages.extend(rid, min(end, self._kv_positions(n, params)), known)
            for group, first, pages in self.pages.changes(rid):
                runs.append(PageRun(group, request.slot, first, tuple(-1 if p is None else p for p in pages)))
        return tuple(runs)

    def _chunk(self, request: Request, budget: int) -> tuple[int, int]:
        """The next chunk of a request's prompt within `budget` positions (at least one)."""
        start = request.prefilled
        end = min(len(request.prompt), start + max(budget, 1))
        request.prefilled = end
        if self.pages is not None:   # written in this command's first step, before anything later reads them
            self.pages.extend(request.request_id, end, start)
            self.pages.register(request.request_id, request.prompt, written=end)
        return start, end

    def schedule(self, ahead: bool = False) -> Command | None:
        """The next command: pending releases, then waiting requests into the lowest free slots (in order:
        one the KV pool cannot take yet waits, and those behind it). With `ahead` (commands are in
        flight), None unless it has a forward worth queueing behind them."""
        if ahead and not self._worth_queueing():
            return None
        admit, chunks = [], {}
        free = [s for s, r in enumerate(self._slots) if r is None]
        # requests whose long prompts are prefilled a chunk a command, in turn; while others wait for a free
        # slot, at most half the budget, so a short prompt behind a long one starts without waiting for it
        budget = self.prefill_chunk
        held_back = budget // 2 if self._waiting and free and budget > 1 else 0
        for request in self._slots:
            if request is not None and request.prefilled < len(request.prompt) and budget > held_back:
                start, end = chunks[request.request_id] = self._chunk(request, budget - held_back)
                budget -= end - start
        for slot in free[: len(self._waiting)]:
            request = self._waiting[0]
            if budget <= 0:   # this command's prefill is full: the next takes it
                break
            if self.pages is not None:
                got = self.pages.admit(request.request_id, request.prompt,
                                       self._kv_positions(len(request.prompt), request.params),
                                       self._ahead(len(request.prompt), request.params), request.page_addresses)
                if got is None:
                    break
                request.cached_tokens, request.page_addresses = got.cached_tokens, None   # the pool holds them now
            request.prefilled = request.cached_tokens
            # its first chunk's pages are cached at once: a request admitted beside it reads them in the
            # same prefill pass, and later ones after it
            start, end = chunks[request.request_id] = self._chunk(request, budget)
            budget -= end - start
            self._waiting.popleft()
            request.slot = slot
            request.steps_left = self.budget.at_admission(request.params) if self.budget else None
            self._slots[slot], self._admitted_by[slot] = request, self._scheduled
            admit.append(NewSlot(slot, request.prompt, request.params, request.seed, request.cached_tokens))
        running = [r for r in self._slots if r is not None]
        if not (running or admit or self._release):
            return None
        release, self._release = tuple(self._release), []
        self._scheduled += 1
        # With nothing left running, the command only frees slots; with nothing decoding yet (every request
        # mid-prefill), it is its prefill alone: the next chunk comes with the next command. So is a
        # command that ends an AR request's prompt: that request's first token is its prefill's
        # prediction, and it streams at the prefill's end rather than after a command's steps (the steps
        # come in the command queued behind it). Rows already decoding lose that command's boundary, and
        # never two in a row: while AR requests keep arriving, every other command runs their steps.
        decoding = [r for r in running if r.prefilled >= len(r.prompt)]
        first_token = any(r.params.mode == "ar" and r.request_id in chunks for r in decoding)
        others = any(r.request_id not in chunks for r in decoding)
        alone = first_token and not (others and self._held_back)
        steps = self._command_steps(decoding) if decoding and not alone else 0
        self._held_back = alone and others
        # slots that free with the commands in flight or within a short command: where the next requests go
        freeing = sum(r.steps_left is not None and r.steps_left <= self.admission_steps for r in running)
        few = len(running) - freeing <= self.num_slots // 2
        short = few and not self._waiting and bool(admit or freeing or any(o for _, o in self._in_flight))
        if short:   # a burst may be arriving
            steps = min(steps, self.admission_steps)
        for request in decoding:   # a request still mid-prefill runs none of them
            if request.steps_left is not None:
                request.steps_left = max(request.steps_left - steps, 0)
        runs = self._page_runs(chunks, running, steps) if self.pages is not None else ()
        # an admitted request whose prompt (past its cached prefix) is prefilled whole needs no run: the shard
        # prefills a new slot whole unless told otherwise
        whole = {a.slot: (a.cached, len(a.prompt)) for a in admit}
        prefill = tuple(PrefillRun(r.slot, *chunks[r.request_id]) for r in running
                        if r.request_id in chunks and whole.get(r.slot) != chunks[r.request_id])
        self._in_flight.append((steps, short and bool(admit)))
        return Command(release, tuple(admit), steps, runs, prefill)

    def _worth_queueing(self) -> bool:
        """A queued command is worth it if it admits a waiting request into a free slot, or, unless a
        slot frees with the commands in flight while requests wait, if a request outlasts them."""
        occupied = [r for r in self._slots if r is not None]
        if self._waiting and len(occupied) < self.num_slots:
            return True
        if self._waiting and any(r.steps_left == 0 for r in occupied):
            return False
        return any(r.steps_left is None or r.steps_left > 0 for r in occupied)

    def _command_steps(self, running: list[Request]) -> int:
        bounds = [r.steps_left for r in running]
        if None in bounds:
            return self.max_steps_per_command
        # a 0 is a slot finishing with the commands in flight (one scheduled ahead): not a reason to stop
        target = min((b for b in bounds if b > 0), default=1) if self._waiting else max(bounds)
        return max(1, min(self.max_steps_per_command, target))

    def apply(self, events: Events) -> list[RequestOutput]:
        """Appends each block to its slot's request, truncated at a stop id or max_tokens (see
        Request.extend); a request that finished gives its slot back in the next command."""
        assert self._applied < self._scheduled, "events for a command that was never scheduled"
        command = self._applied
        self._applied += 1
        self._in_flight.popleft()
        # steps handed out after this command: its bounds predate them
        later = sum(steps for steps, _ in self._in_flight)
        self.counters.add(events.counters)
        for slot, bound in events.steps_left.items():
            request = self._slots[slot]
            if request is not None and self._admitted_by[slot] <= command:
                request.steps_left = max(bound - later, 0)
        outputs = []
        slots = set()
        for block in events.blocks:
            assert 0 <= block.slot < self.num_slots and block.slot not in slots, f"block for slot {block.slot}"
            slots.add(block.slot)
            request = self._slots[block.slot]
            if request is None or self._admitted_by[block.slot] > command:
                continue
            output = request.extend(block)
            if self.pages is not None:   # its committed pages are cached (a finished one's too: the next turn's)
                self.pages.register(request.request_id, request.prompt + tuple(request.output), block.length)
            if output.finished:
                self._vacate(block.slot)
            outputs.append(output)
        return outputs

    def _vacate(self, slot: int) -> None:
        request = self._slots[slot]
        assert request is not None and slot not in self._release, slot
        self._slots[slot] = None
        self._release.append(slot)
        del self._live[request.request_id]
        if self.pages is not None:   # commands already made finish writing them before later ones run
            self.pages.free(request.request_id)


def derived_metrics(c: StepCounters, wall_time_s: float) -> dict[str, float | None]:
    """docs/spec.md section 8's derived metrics; a ratio whose denominator is 0 is None (undefined, not 0)."""
    def ratio(num: float, den: float) -> float | None:
        return num / den if den > 0 else None

    return {
        "committed_throughput": ratio(c.committed_tokens, wall_time_s),   # tokens / s
        "steps_per_canvas": ratio(c.denoising_steps, c.canvases),
        "committed_per_denoising_step": ratio(c.committed_tokens, c.denoising_steps),
        "tokens_per_forward": ratio(c.committed_tokens, c.forwards),
        "rows_per_pass": ratio(c.forwards, c.passes),
    }
