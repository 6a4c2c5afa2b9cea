"""One rank's executor of batch commands (docs/spec.md 1, 3, 4, 5, 6).

    execute(command): release and admit slots, prefill, run exactly `max_steps` steps, copy the results out

A command first prefills its prompt chunks (newly admitted slots, a long prompt's next chunk); a command
of no steps is that prefill alone. A step is one forward over every canvas-wide row (denoise, commit,
draft or verify, each at its own phase) and one over every AR row, each followed by its sampler and
state update; AR rows ride in the canvas forward where that costs less than a second read of the weights
(`ar_rides`). Per-slot state stays on the device, so the host reads nothing until the command ends. On CUDA every step replays a graph of the closed set that `warm_up`
captures before a shard serves. The step loop, graphs and batch invariance: docs/design.md.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from model.batch_invariant import batch_invariant
from model.checkpoint import RunnerArgs
from model.compile_watch import CompileWatch
from model.config import RenoiseDefaults
from model.drafts import DraftBuffer
from model.families import FAMILIES
from model.grammar.guide import GrammarGuide
from model.grammar.tokenizer import grammar_tokenizer
from model.graphs import (MIN_PREFILL_WIDTH, StepGraphs, bucket, capture_sizes, graph_widths, key_buckets, padded_size,
                          prefill_width)
from model.interface import DiffusionLM
from model.kv_budget import ahead_positions, memory_budget, pool_pages, sliding_pages
from model.outputs import CommandOutputs
from model.parallel.group import TPGroup
from model.protocol import PAGE_SIZE, Command, Events, NewSlot, PrefillRun
from model.sampling.stats import TORCH_PASSES, VocabPasses
from model.slots import Admission, SlotInfo, SlotTable
from model.steps.causal import CausalSteps
from model.steps.compiled import CompiledUpdate
from model.steps.env import StepEnv
from model.steps.plan import RowPlan, graph_plan, plan_rows
from model.steps.sampler import RowSampler

log = logging.getLogger("dllm.runner")

CANVAS_MODES = ("diffusion", "linear_spec")
# A forward costs about a + b * tokens: a the weights' read (and the fixed work of a step), b each token's
# compute. Riding in the canvas forward gives each AR row the canvas's width (C tokens, not 1) and saves
# the AR forward's a, so it pays while the tokens it adds stay under a / b. The 8B's bf16 step on the H200,
# 5.36 ms at 32 tokens and 15.57 ms at 512, puts a / b near 220 tokens; 192 leans to two forwards. (FP8
# weights halve both a and b.) A token's attention over its keys adds to b: Runner.keys_per_token.
AR_RIDE_TOKENS = 192


class Runner:
    def __init__(self, model: DiffusionLM, num_slots: int, max_model_len: int, device: torch.device | str = "cpu",
                 cuda_graphs: bool | None = None, renoise_defaults: RenoiseDefaults | None = None,
                 max_steps_per_command: int = 64, sampler_passes: VocabPasses = TORCH_PASSES,
                 batch_invariant: bool = False, ar_ride_tokens: int = AR_RIDE_TOKENS,
                 kv_pages: list[int] | None = None, tokenizer_dir: str | None = None):
        """The model's family (model/families.py) gives the canvas step and the step budget;
        renoise_defaults: a uniform-noise family's schedule defaults (the checkpoint's generation_config.json;
        None: transformers' defaults); ar_ride_tokens: the most tokens AR rows may add to a canvas forward
        by riding in it (-1: never); kv_pages: the KV pool's pages per layer group, whose page tables the
        scheduler's commands set (None: every slot its own pages for max_model_len positions); tokenizer_dir:
        the checkpoint's tokenizer, which constrained requests' grammars read (None: the runner takes none)."""
        cfg = model.config
        self.family = FAMILIES[cfg.model_type]
        self.model, self.device = model, torch.device(device)
        self.C = cfg.canvas_length
        self.max_model_len = max_model_len
        # the compute dtype: an FP8 model's quantized weights are one byte; its norms and embeddings are not
        dtype = next(p.dtype for p in model.parameters() if p.element_size() > 1)
        if batch_invariant and (self.device.type != "cuda" or dtype == torch.float64):
            raise ValueError("batch_invariant needs device cuda and a bf16/fp16/fp32 model (its fixed-order "
                             "kernels are triton's)")
        self.batch_invariant = batch_invariant
        self.ar_ride_tokens = ar_ride_tokens
        self.keys_per_token = keys_per_token(model)
        # + C: a canvas (or a verify) may write scratch KV past the budget's last token
        kv = model.kv_layout.cache(num_slots, max_model_len + self.C, dtype, self.device, kv_pages)
        self.managed_pages = kv_pages is not None
        # (gpu_memory_utilization, prefill_chunk) where warm_up sizes the pool from the device's memory
        self.pool_sizing: tuple[float, int] | None = None
        self.pool_report: dict = {}
        self.prefilling: set[int] = set()   # slots whose prompt is prefilled a chunk at a time, not to its end yet
        # a linear speculation verify is constrained at every draft position at once (docs/spec.md 12); a
        # runner without its tokenizer takes no grammar
        width = self.C if "linear_spec" in self.family.constrained_modes and tokenizer_dir is not None else 1
        slots = SlotTable(num_slots, self.C, cfg.mask_token_id or 0, self.device, cfg.vocab_size, width)
        load = None if tokenizer_dir is None else \
            (lambda: grammar_tokenizer(tokenizer_dir, cfg.vocab_size, cfg.eos_token_ids))
        self.grammar = GrammarGuide(slots, load, cfg.eos_token_ids, cfg.mask_token_id)
        self.env = StepEnv(model=model, kv=kv, slots=slots,
                           outputs=CommandOutputs(num_slots, self.C, max_steps_per_command, self.device),
                           drafts=DraftBuffer(num_slots, self.C, max_steps_per_command, self.device),
                           sampler=RowSampler(model, slots, sampler_passes),
                           eos=torch.tensor(cfg.eos_token_ids, dtype=torch.int64, device=self.device), dtype=dtype)
        self.slots, self.outputs, self.drafts = slots, self.env.outputs, self.env.drafts
        renoise = (renoise_defaults or RenoiseDefaults()) if self.family.uniform_noise else None
        self.canvas_step = self.family.resolve(self.family.canvas_step)(self.env, *((renoise,) if renoise else ()))
        self.causal = CausalSteps(self.env, self.canvas_step)
        if self.family.uniform_noise:   # what the grammar checks of a uniform-noise canvas: its argmax
            self.grammar.argmax = self.canvas_step.prev_argmax
        # each slot's steps_limit, and the bound on its remaining steps reported with every command's events
        self.budget = self.family.step_budget(self.C, renoise)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = StepGraphs(self.device) if use_graphs else None
        self.sizes = capture_sizes(num_slots)   # the batch sizes of graphs (model/graphs.py)
        self.compiles: CompileWatch | None = None   # on CUDA, from the warm-up's end: what compiled while serving

    @classmethod
    def from_checkpoint(cls, args: RunnerArgs, tp: TPGroup | None = None) -> "Runner":
        """The runner of `args.checkpoint` for one tensor-parallel rank, its weights loaded (or dummy)."""
        from model.loader import load_model

        ckpt = args.checkpoint
        model = load_model(ckpt.path, tp or TPGroup(), dtype=args.dtype, device=args.device,
                           load_format=args.load_format, config=ckpt.config)
        C = ckpt.config.canvas_length
        by_memory = args.kv_cache_tokens is None and str(args.device).startswith("cuda")
        tokens = args.kv_cache_tokens or args.num_slots * (args.max_model_len + C)
        # sized from memory: a page a group until size_pool has measured the steps
        pages = 1 if by_memory else -(-tokens // PAGE_SIZE)
        runner = cls(model, num_slots=args.num_slots, max_model_len=args.max_model_len, device=args.device,
                     renoise_defaults=ckpt.renoise, max_steps_per_command=args.max_steps_per_command,
                     sampler_passes=sampler_passes(args.device), batch_invariant=args.batch_invariant,
                     kv_pages=[pages] * len(model.kv_layout.group_windows), tokenizer_dir=str(ckpt.path))
        if by_memory:
            runner.pool_sizing = (args.gpu_memory_utilization, args.prefill_chunk)
        return runner

    @property
    def pool(self) -> dict:
        """The KV pool (model/attention.py), as the scheduler manages it (workers/kv_pages.py): each layer
        group's pages and sliding window, and the page size."""
        return {"kv_groups": [{"num_pages": n, "window": w} for n, w in zip(self.kv.num_pages, self.kv.windows)],
                "page_size": self.kv.page_size}

    @property
    def tp(self) -> TPGroup:
        return self.model.tp

    @property
    def kv(self):
        return self.env.kv

    @property
    def observer(self):
        """Tests watch steps through this (model/steps/env.py); steps then run eagerly."""
        return self.env.observer

    @observer.setter
    def observer(self, observe) -> None:
        self.env.observer = observe

    # ---- commands -------------------------------------------------------------------------------
    def execute(self, cmd: Command) -> Events:
        start = time.perf_counter()
        events = self._execute(cmd)
        events.execute_s = time.perf_counter() - start
        return events

    def _execute(self, cmd: Command) -> Events:
        with torch.inference_mode(), batch_invariant(self.batch_invariant):
            for slot in cmd.release:
                self.slots.info.pop(slot, None)
                self.prefilling.discard(slot)
            self.grammar.release(list(cmd.release))
            if cmd.release and self.managed_pages:   # a freed slot's table points at no page another may hold
                self.kv.clear_pages(self.slots.device_index(list(cmd.release)))
            if cmd.pages:
                self._set_pages(cmd.pages)
            admitted = self._admit(cmd.admit)
            runs = self._prefill_runs(cmd, admitted)
            events = Events()
            # a command of no steps that prefills is a prefill alone: its AR rows' first tokens (the
            # prefill's predictions) come back without waiting for a step (workers/scheduler.py)
            if not self.slots.info or not (cmd.max_steps or runs):
                return events
            if cmd.max_steps > self.outputs.max_steps:
                raise ValueError(f"max_steps={cmd.max_steps} > the runner's max_steps_per_command="
                                 f"{self.outputs.max_steps}")
            self.outputs.reset()
            self.drafts.reset()
            steps = cmd.max_steps
            canvas, ar = self._forwards(steps) if steps else ([], [])
            # the keys each forward may read in the command (the host's lengths change only at its end)
            canvas_keys = self._keys(canvas, steps, self.C) if canvas else 0
            ar_keys = self._keys(ar, steps, 1) if ar else 0
            if runs:
                self._prefill(runs)
            for _ in range(steps):
                if canvas:
                    spans = self.grammar.check(canvas)
                    self._run("canvas", self.canvas_step, canvas, canvas_keys, spans)
                if ar:
                    self.grammar.check(ar)
                    self._run("ar", self.causal.ar_step, ar, ar_keys)
            events.steps = steps
            scored = {s: i.params.logprobs for s, i in self.slots.info.items() if i.wants_scores}
            drafting = [s for s, i in sorted(self.slots.info.items()) if i.params.stream_drafts]
            events.blocks, events.counters = self.outputs.copy_out(self.slots, sorted(self.slots.info), scored,
                                                                   self.drafts, drafting, steps)
            t = self.slots
            # a slot still mid-prefill has no phase yet: the scheduler keeps its bound from admission
            events.steps_left = {s: self.budget.left(i.params, t.host_phase[s], t.host_n[s], t.host_emitted[s])
                                 for s, i in self.slots.info.items() if s not in self.prefilling}
            if self.graphs is not None:
                events.graphs = {"eager_steps": self.graphs.eager_steps,
                                 "captured_after_ready": self.graphs.captured - self.graphs.captured_at_freeze,
                                 "kernel_compiles": self.compiles.count if self.compiles is not None else 0}
            return events

    def _prefill_runs(self, cmd: Command, admitted: list[int]) -> list[PrefillRun]:
        """The command's prompt chunks, an admitted slot without one prefilled whole; a slot whose prompt
        is not prefilled to its end by them decodes nothing in this command."""
        runs = list(cmd.prefill)
        chunked = {r.slot for r in runs}
        runs += [PrefillRun(s, self.slots.info[s].cached, len(self.slots.info[s].prompt)) for s in admitted
                 if s not in chunked]
        for r in runs:
            prompt = self.slots.info[r.slot].prompt
            if not 0 <= r.start < r.end <= len(prompt):
                raise ValueError(f"slot {r.slot}: prefill [{r.start}, {r.end}) of a {len(prompt)}-token prompt")
            if r.end < len(prompt):
                self.prefilling.add(r.slot)
            else:
                self.prefilling.discard(r.slot)
        return runs

    def _forwards(self, steps: int) -> tuple[list[int], list[int]]:
        """The slots of each step's canvas forward and of its AR forward: the AR rows ride in the canvas
        forward (model/steps/masked.py) where the family's canvas step takes them and the extra width
        costs less than a second read of the weights (AR_RIDE_TOKENS). Not in the batch-invariant mode:
        an AR row's bits would then depend on whether canvas rows share its step."""
        ready = [(s, i) for s, i in sorted(self.slots.info.items()) if s not in self.prefilling]
        canvas = [s for s, i in ready if i.params.mode in CANVAS_MODES]
        ar = [s for s, i in ready if i.params.mode == "ar"]
        if canvas and ar and self.ar_rides(len(canvas), len(ar), self._keys(canvas + ar, steps, self.C)):
            return sorted(canvas + ar), []
        return canvas, ar

    def ar_rides(self, canvas_rows: int, ar_rows: int, kv_len: int = 0) -> bool:
        """Whether ar_rows AR rows ride in the forward of canvas_rows canvas rows reading up to kv_len keys:
        the tokens they add (rows padded to capture sizes where graphs run) minus the AR forward's own,
        each weighed with its attention over kv_len keys, at most ar_ride_tokens."""
        if self.batch_invariant or self.ar_ride_tokens < 0 or not getattr(self.canvas_step, "takes_ar_rows", False):
            return False
        pad = (lambda n: padded_size(n, self.sizes)) if self.graphs is not None else (lambda n: n)
        added = (pad(canvas_rows + ar_rows) - pad(canvas_rows)) * self.C - pad(ar_rows)
        return added * (1 + kv_len / self.keys_per_token) <= self.ar_ride_tokens

    def warm_up(self) -> dict:
        """Before serving, on a runner with no slots in use: captures the closed set of graphs
        (model/graphs.py), each run once eagerly on padding rows first, which also compiles the canvas
        steps' state updates (model/steps/compiled.py); then freezes both. Every rank calls it, in
        lockstep (its steps run the collectives). Returns what it did: the graphs by kind, the seconds it
        took (and by kind, with each kind's longest capture: the compiles land in the first capture of
        each new kind of plan) and the device memory the graphs hold."""
        assert not self.slots.info, "warm_up runs before any slot is admitted"
        start = time.perf_counter()
        self.size_pool()
        counts: dict[str, int] = {}
        seconds: dict[str, float] = {}
        longest: dict[str, float] = {}
        if self.graphs is not None:
            with torch.inference_mode(), batch_invariant(self.batch_invariant):
                for kind, key, step, inputs in self._graph_set():
                    began = time.perf_counter()
                    self.graphs.capture(key, step, *inputs)
                    took = time.perf_counter() - began
                    counts[kind] = counts.get(kind, 0) + 1
                    seconds[kind] = seconds.get(kind, 0.0) + took
                    longest[kind] = max(longest.get(kind, 0.0), took)
                self._warm_eager_prefills()
            self.graphs.freeze()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                if self.compiles is None:
                    self.compiles = CompileWatch(on_compile=_compiled_while_serving).start()
        if isinstance(self.canvas_step.update, CompiledUpdate):
            self.canvas_step.update.freeze()
        return {"graphs": counts, "capture_sizes": list(self.sizes), "key_buckets": list(key_buckets(self.kv.max_len)),
                "seconds": time.perf_counter() - start, "seconds_by_kind": seconds, "longest_by_kind": longest,
                "graph_bytes": self.graphs.pool_bytes() if self.graphs is not None else 0, **self.pool,
                **self.pool_report}

    def size_pool(self) -> None:
        """Where the pool is sized from memory and is not yet (once, before any slot is admitted; every rank
        in lockstep), replaces the provisional pool with what the device's memory holds (model/kv_budget.py):
        the largest step of each kind in the graph set runs eagerly on padding rows, whose KV goes to the
        sink, for the steps' peak working memory; every rank takes the smallest pool any rank can."""
        if self.pool_sizing is None:
            return
        assert not self.slots.info, "the pool is sized before any slot is admitted"
        (utilization, prefill_chunk), self.pool_sizing = self.pool_sizing, None
        graphs, self.graphs = self.graphs, self.graphs or StepGraphs(self.device, capture=False)
        largest = largest_steps(self._graph_set())
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode(), batch_invariant(self.batch_invariant):
            for _, step, inputs in largest.values():
                step(*inputs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.graphs = graphs
        layout, kv = self.model.kv_layout, self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = memory_budget(total, free, utilization, peak) + kv.nbytes   # the provisional pool goes
        windows = layout.group_windows
        ahead = ahead_positions(self.max_model_len, prefill_chunk, self.outputs.max_steps, self.C)
        cap = self.slots.num_slots * max((sliding_pages(w, ahead, kv.page_size) for w in windows if w), default=0)
        pages = pool_pages(budget, layout.page_bytes(self.env.dtype, kv.page_size), windows, cap)
        agreed = self.tp.all_reduce(torch.tensor(pages, dtype=torch.int64, device=self.device), dist.ReduceOp.MIN)
        pages = [int(p) for p in agreed.tolist()]
        need = -(-(self.max_model_len + self.C) // kv.page_size)
        if min(p for p, w in zip(pages, windows) if w is None) < need:
            raise ValueError(f"gpu_memory_utilization={utilization} leaves the KV cache {pages[0]} pages of "
                             f"{kv.page_size} positions, fewer than one request of max_model_len="
                             f"{self.max_model_len} needs ({need}): raise gpu_memory_utilization, or lower "
                             "max_model_len or max_num_seqs, or set kv_cache_tokens")
        self.env.kv = kv = None
        torch.cuda.empty_cache()
        self.env.kv = layout.cache(self.slots.num_slots, self.max_model_len + self.C, self.env.dtype, self.device,
                                   pages)
        self.pool_report = {"kv_sizing": {"gpu_memory_utilization": utilization, "total_bytes": total,
                                          "steps_peak_bytes": peak, "pool_bytes": self.kv.nbytes}}

    def _graph_set(self):
        """(kind, key, step, inputs) of every graph a served step can need: see model/graphs.py."""
        pad, max_len = self.slots.pad, self.kv.max_len
        scores_at_prefill = self.canvas_step.needs_prediction
        kinds = [("canvas", self.canvas_step)] + ([("ar", self.causal.ar_step)] if "ar" in self.family.modes else [])
        for rows in self.sizes:
            for scored in (False, True):
                for kind, step in kinds:
                    for kv_len in key_buckets(max_len):
                        key, run, inputs = self._step_graph(kind, step, [pad] * rows, kv_len, scored)
                        yield kind, key, run, inputs
                if scored and not scores_at_prefill:
                    continue
                for fresh in (True, False):
                    for width in graph_widths(rows, max_len, fresh):
                        key, plan = self._prefill_key(rows, width, scored, fresh)
                        host = self._prefill_inputs([None] * rows, [None] * rows, plan, width)
                        yield key[0], key, self._prefill_step(plan, fresh), self.graphs.static_inputs(key, *host)

    def _warm_eager_prefills(self) -> None:
        """Runs, eagerly, prefills past a prefix (a cached prefix, a long prompt's later chunk) of one and of
        two padding rows over the longest key bucket, with scores and without: few programs over many keys,
        so attention splits its keys, at both of its tile sets (one row, several), and those variants and the
        splits' combine compile now, not mid-service (the graph set's steps may never split:
        DiffusionGemma's 256-wide canvases fill the SMs). The padding slot's keys are the sink's; its length
        is put back."""
        t, pad, width = self.slots, self.slots.pad, MIN_PREFILL_WIDTH
        length = t.length[pad].clone()
        for rows in [r for r in (1, 2) if r <= t.num_slots]:
            for scored in dict.fromkeys((False, self.canvas_step.needs_prediction)):
                plan = graph_plan(rows, self.kv.max_len, scored)
                self._prefill_step(plan, fresh=False)(
                    t.device_index([pad] * rows), t.device_index(list(plan.scored)),
                    torch.zeros(rows, width, dtype=torch.int64, device=self.device),
                    t.device_index([width] * rows), t.device_index([1] * rows),
                    torch.zeros(rows, 3, dtype=torch.bool, device=self.device))
        t.length[pad] = length

    def _admit(self, news: tuple[NewSlot, ...]) -> list[int]:
        for new in news:
            p = new.params
            if not 0 <= new.slot < self.slots.num_slots or new.slot in self.slots.info:
                raise ValueError(f"slot {new.slot} is not free")
            if len(new.prompt) + p.max_tokens > self.max_model_len:
                raise ValueError(f"prompt ({len(new.prompt)}) + max_tokens ({p.max_tokens}) > max_model_len")
            self.family.check(p)
        if not news:
            return []
        knobs = [self.canvas_step.knobs(n.params) for n in news]
        slots = [n.slot for n in news]
        self.slots.admit(slots, [Admission(n.params, n.seed, self.budget.canvas_steps(n.params), k["gamma"])
                                 for n, k in zip(news, knobs)])
        self.drafts.admit(slots, [n.params.draft_every if n.params.stream_drafts else 0 for n in news])
        self.canvas_step.admit(slots, knobs)
        self.grammar.admit(slots, [n.params for n in news])
        for n in news:
            self.slots.info[n.slot] = SlotInfo(n.params, tuple(n.prompt), n.cached)
        return slots

    def _set_pages(self, runs) -> None:
        """The commands' page table entries (model.protocol.PageRun): one copy per layer group."""
        kv, pinned = self.kv, self.device.type == "cuda"
        for group in range(len(kv.page_table)):
            mine = [r for r in runs if r.group == group]
            if not mine:
                continue
            flat = [r.slot * kv.max_pages + r.first + i for r in mine for i in range(len(r.pages))]
            pages = [p for r in mine for p in r.pages]
            host = torch.tensor([flat, pages], dtype=torch.int64, pin_memory=pinned)
            dev = host.to(self.device, non_blocking=True)
            kv.write_pages(group, dev[0], dev[1])

    def _keys(self, slots: list[int], steps: int, width: int) -> int:
        """Keys a row can read within the command: its length now (at least its prompt's: a new slot's, or
        one whose last chunk this command prefills) plus what the command can commit (a canvas every other
        step, or one AR token per step) plus its own width."""
        t = self.slots
        start = max(max(len(t.info[s].prompt), t.host_length[s]) for s in slots)
        growth = -(-steps // 2) * self.C if width == self.C else steps + 1
        return bucket(start + growth + width, self.kv.max_len)

    def plan(self, slots: list[int], kv_len: int):
        return plan_rows([self.slots.info[s] for s in slots], kv_len, self.family.uniform_noise)

    def _prefill(self, runs: list[PrefillRun]) -> None:
        """The runs' prompt chunks in one causal pass; on CUDA a graph's replay, rows padded to a capture size
        and chunks to a prefill width (model/graphs.py), or eagerly where too wide for a graph (past a cached
        prefix or a prompt's first chunk: wider than PAST_PREFIX_GRAPH_WIDTH). A chunk short of its
        prompt's end writes KV only."""
        slots = [r.slot for r in runs]
        infos = [self.slots.info[s] for s in slots]
        longest = max(r.end - r.start for r in runs)
        fresh = not any(r.start for r in runs)
        rows = width = None
        if self.graphed:
            rows = padded_size(len(slots), self.sizes)
            width = prefill_width(longest, rows, self.kv.max_len, fresh)
        scored = self.canvas_step.needs_prediction and any(i.wants_scores for i in infos)
        if width is None:   # eager
            self._count_eager()
            width = longest
            if self.graphed:
                # the graph set's kernel variants only (a variant compiled mid-service stalls the replica):
                # a width of whole MIN_PREFILL_WIDTH tiles, the graphs' plan (every pass on)
                width = -(-longest // MIN_PREFILL_WIDTH) * MIN_PREFILL_WIDTH
            kv_len = width if fresh else bucket(max(r.end for r in runs), self.kv.max_len)
            plan = self._eager_plan(slots, kv_len, scored)
            host = self._prefill_inputs(runs, infos, plan, width)
            self._prefill_step(plan, fresh)(*(h.to(self.device, non_blocking=True) for h in host))
            return
        pad = rows - len(slots)
        key, plan = self._prefill_key(rows, width, scored, fresh)
        host = self._prefill_inputs(runs + [None] * pad, infos + [None] * pad, plan, width)
        self.graphs.run(key, self._prefill_step(plan, fresh), *self.graphs.static_inputs(key, *host))

    def _prefill_key(self, rows: int, width: int, scored: bool, fresh: bool) -> tuple[tuple, RowPlan]:
        """A graphed prefill's key and plan: from position 0 its keys are its own (`width`); past a
        cached prefix it reads the cache's whole length (its rows' real keys are device data)."""
        if fresh:
            plan = graph_plan(rows, width, scored)
            return ("prefill", plan), plan
        plan = graph_plan(rows, self.kv.max_len, scored)
        return ("prefill_past", plan, width), plan

    def _prefill_step(self, plan: RowPlan, fresh: bool = True):
        return lambda *inputs: self.causal.prefill(plan, *inputs, fresh=fresh)

    def _prefill_inputs(self, runs: list[PrefillRun | None], infos: list[SlotInfo | None], plan: RowPlan,
                        width: int) -> tuple[torch.Tensor, ...]:
        """Pinned host tensors of a prefill: slots, scored rows, tokens [B, width] (each run's chunk),
        starts, lengths, modes [B, 3] (a padding row, run None: the padding slot, one token 0 at 0; a
        chunk short of its prompt's end: no mode, so nothing of its slot but its length changes)."""
        pinned = self.device.type == "cuda"
        tokens = torch.zeros(len(runs), width, dtype=torch.int64, pin_memory=pinned)
        modes = []
        for row, (run, info) in enumerate(zip(runs, infos)):
            if run is not None:
                tokens[row, : run.end - run.start] = torch.tensor(info.prompt[run.start:run.end])
            final = run is not None and run.end == len(info.prompt)
            modes.append(info.params.mode if final else None)
        return (torch.tensor([self.slots.pad if r is None else r.slot for r in runs], dtype=torch.int64,
                             pin_memory=pinned),
                torch.tensor(list(plan.scored), dtype=torch.int64, pin_memory=pinned), tokens,
                torch.tensor([0 if r is None else r.start for r in runs], dtype=torch.int64, pin_memory=pinned),
                torch.tensor([1 if r is None else r.end - r.start for r in runs], dtype=torch.int64,
                             pin_memory=pinned),
                torch.tensor([[mode == m for m in ("diffusion", "linear_spec", "ar")] for mode in modes],
                             dtype=torch.bool, pin_memory=pinned))

    def _run(self, kind: str, step, slots: list[int], kv_len: int, spans: set[int] = frozenset()) -> None:
        """One step over rows `slots`; `spans`: those whose step a grammar limits at several positions (a
        constrained verify): the step runs eagerly, so the graphs' steps mask one position a row
        (model/steps/env.py)."""
        if not self.graphed or spans:
            if self.graphs is not None and spans:
                self._count_eager()
            plan = self._eager_plan(slots, kv_len, any(self.slots.info[s].wants_scores for s in slots))
            if spans:
                plan = dataclasses.replace(plan, spans=tuple(r for r, s in enumerate(slots) if s in spans))
            step(plan, self.slots.device_index(slots), self.slots.device_index(list(plan.scored)))
            return
        rows = padded_size(len(slots), self.sizes)
        key, run, inputs = self._step_graph(kind, step, slots + [self.slots.pad] * (rows - len(slots)), kv_len,
                                            any(self.slots.info[s].wants_scores for s in slots))
        self.graphs.run(key, run, *inputs)

    @property
    def graphed(self) -> bool:
        """Steps go through the graph set (CUDA graphs, or their CPU stand-in), not all eagerly: the runner
        has graphs and no observer (which reads every step)."""
        return self.graphs is not None and self.observer is None

    def close(self) -> None:
        """Stops counting this process's compiles for this runner (its watch would else outlive it)."""
        if self.compiles is not None:
            self.compiles.stop()

    def _eager_plan(self, slots: list[int], kv_len: int, scored: bool) -> RowPlan:
        """An eager step's plan: exact without graphs; on a graphed runner (observers aside) the graphs'
        (every pass on, the same tokens and scores: model/steps/plan.py), whose kernels' compile-time flags
        the warm-up compiled."""
        return graph_plan(len(slots), kv_len, scored) if self.graphed else self.plan(slots, kv_len)

    def _step_graph(self, kind: str, step, idx: list[int], kv_len: int, scored: bool):
        """The graph key, the step and its static inputs for rows idx (padding included)."""
        plan = graph_plan(len(idx), kv_len, scored)
        # what else changes a step's code: whether self-conditioning runs (off only to measure its cost)
        key = (kind, plan, getattr(step, "self_conditioning", None))
        return key, (lambda i, s: step(plan, i, s)), self.graphs.index_inputs(key, idx, list(plan.scored))

    def _count_eager(self) -> None:
        if self.graphs is not None and self.graphs.frozen:
            self.graphs.eager_steps += 1


def largest_steps(graph_set) -> dict[str, tuple]:
    """Of each kind in a graph set ((kind, key, step, inputs) items), the one whose working memory is the
    largest: (its size, step, inputs). A prefill's goes with its tokens (rows x width: the most rows are
    not the most tokens), a step's with its rows and the keys they read."""
    largest: dict[str, tuple] = {}
    for kind, key, step, inputs in graph_set:
        plan = key[1]
        size = plan.rows * (key[2] if kind == "prefill_past" else plan.kv_len)
        if kind not in largest or size >= largest[kind][0]:
            largest[kind] = (size, step, inputs)
    return largest


def _compiled_while_serving(name: str, seconds: float) -> None:
    log.warning("kernel %s compiled while serving (%.2f s, every request of the replica waited): a shape the "
                "warm-up did not run", name, seconds)


def keys_per_token(model: DiffusionLM) -> float:
    """How many keys a token attends to for the FLOPs of its pass through the linear layers: 2 x their
    parameters against 4 x heads x head_dim per key and layer (QK and PV), on this rank's share of both."""
    cfg = model.config
    vocab = cfg.vocab_size
    linear = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and vocab not in p.shape)
    heads = cfg.num_attention_heads // model.tp.world_size
    per_key = 4 * heads * (getattr(cfg, "head_size", None) or cfg.head_dim) * cfg.num_hidden_layers
    return 2 * linear / per_key


def sampler_passes(device: str) -> VocabPasses:
    """The sampler's passes over the vocabulary: triton's on CUDA, torch's elsewhere."""
    if not str(device).startswith("cuda"):
        return TORCH_PASSES
    from model.kernels.vocab_stats import TRITON_PASSES

    return TRITON_PASSES
