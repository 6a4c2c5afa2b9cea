"""One rank's executor of batch commands (SPEC.md 1, 3, 4, 5, 6).

    execute(command): release and admit slots, run exactly `max_steps` steps, copy the results out once

A step is: the prefill of newly admitted slots (a command's first step), one forward over every
canvas-wide row (each at its own phase: denoise, commit, draft, verify), one over every AR row, each
followed by its sampler and state update. All per-slot state lives on the device (model/slots.py) and
the step kinds (model/steps) update it with device ops only, so the host reads nothing until the
command ends: then model/outputs.py copies every slot's emitted tokens and scores, the counters and
the slots' lengths and phases in one synchronisation. A slot that finishes mid-command (max_tokens,
an EOS) turns `done` on the device and idles until the command ends; the events carry each slot's
bound on the steps it can still run (model/phases.py), by which the scheduler sizes the next command
so that few steps are spent on idle rows. On CUDA each step replays a graph (model/graphs.py), and a
canvas step's state update is compiled into a few fused kernels (model/steps/compiled.py; `warm_up`
compiles the common plans before a shard serves). A runner made with `batch_invariant=True` runs
each command, captures included, in model.batch_invariant's mode: a slot's results are then the same
bits whatever shares its batch.
"""
from __future__ import annotations

import time

import torch

from model.batch_invariant import batch_invariant
from model.checkpoint import RunnerArgs
from model.config import RenoiseDefaults
from model.drafts import DraftBuffer
from model.families import FAMILIES
from model.graphs import PREFILL_GRAPH_TOKENS, StepGraphs, bucket, prefill_width
from model.interface import DiffusionLM
from model.outputs import CommandOutputs
from model.parallel.group import TPGroup
from model.protocol import Command, Events, NewSlot
from model.sampling.params import DecodeParams
from model.sampling.stats import TORCH_PASSES, VocabPasses
from model.slots import Admission, SlotInfo, SlotTable
from model.steps.causal import CausalSteps
from model.steps.compiled import CompiledUpdate
from model.steps.env import StepEnv
from model.steps.plan import plan_rows
from model.steps.sampler import RowSampler

CANVAS_MODES = ("diffusion", "linear_spec")


class Runner:
    def __init__(self, model: DiffusionLM, num_slots: int, max_model_len: int, device: torch.device | str = "cpu",
                 cuda_graphs: bool | None = None, renoise_defaults: RenoiseDefaults | None = None,
                 max_steps_per_command: int = 64, sampler_passes: VocabPasses = TORCH_PASSES,
                 batch_invariant: bool = False):
        """The model's family (model/families.py) gives the canvas step and the step budget;
        renoise_defaults: a uniform-noise family's schedule defaults (the checkpoint's generation_config.json;
        None: transformers' defaults)."""
        cfg = model.config
        self.family = FAMILIES[cfg.model_type]
        self.model, self.device = model, torch.device(device)
        self.C = cfg.canvas_length
        self.max_model_len = max_model_len
        dtype = next(model.parameters()).dtype
        if batch_invariant and (self.device.type != "cuda" or dtype == torch.float64):
            raise ValueError("batch_invariant needs device cuda and a bf16/fp16/fp32 model (its fixed-order "
                             "kernels are triton's)")
        self.batch_invariant = batch_invariant
        # + C: a canvas (or a verify) may write scratch KV past the budget's last token
        kv = model.kv_layout.cache(num_slots, max_model_len + self.C, self.C, dtype, self.device)
        slots = SlotTable(num_slots, self.C, cfg.mask_token_id or 0, self.device)
        self.env = StepEnv(model=model, kv=kv, slots=slots,
                           outputs=CommandOutputs(num_slots, self.C, max_steps_per_command, self.device),
                           drafts=DraftBuffer(num_slots, self.C, max_steps_per_command, self.device),
                           sampler=RowSampler(model, slots, sampler_passes),
                           eos=torch.tensor(cfg.eos_token_ids, dtype=torch.int64, device=self.device), dtype=dtype)
        self.slots, self.outputs, self.drafts = slots, self.env.outputs, self.env.drafts
        renoise = (renoise_defaults or RenoiseDefaults()) if self.family.uniform_noise else None
        self.canvas_step = self.family.resolve(self.family.canvas_step)(self.env, *((renoise,) if renoise else ()))
        self.causal = CausalSteps(self.env, self.canvas_step)
        # each slot's steps_limit, and the bound on its remaining steps reported with every command's events
        self.budget = self.family.step_budget(self.C, renoise)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = StepGraphs(self.device) if use_graphs else None

    @classmethod
    def from_checkpoint(cls, args: RunnerArgs, tp: TPGroup | None = None) -> "Runner":
        """The runner of `args.checkpoint` for one tensor-parallel rank, its weights loaded (or dummy)."""
        from model.loader import load_model

        ckpt = args.checkpoint
        model = load_model(ckpt.path, tp or TPGroup(), dtype=args.dtype, device=args.device,
                           load_format=args.load_format, config=ckpt.config)
        return cls(model, num_slots=args.num_slots, max_model_len=args.max_model_len, device=args.device,
                   renoise_defaults=ckpt.renoise, max_steps_per_command=args.max_steps_per_command,
                   sampler_passes=sampler_passes(args.device), batch_invariant=args.batch_invariant)

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
            admitted = self._admit(cmd.admit)
            events = Events()
            if cmd.max_steps == 0 or not self.slots.info:
                return events
            if cmd.max_steps > self.outputs.max_steps:
                raise ValueError(f"max_steps={cmd.max_steps} > the runner's max_steps_per_command="
                                 f"{self.outputs.max_steps}")
            self.outputs.reset()
            self.drafts.reset()
            canvas = [s for s, i in sorted(self.slots.info.items()) if i.params.mode in CANVAS_MODES]
            ar = [s for s, i in sorted(self.slots.info.items()) if i.params.mode == "ar"]
            steps = cmd.max_steps
            for k in range(steps):
                if k == 0 and admitted:
                    self._prefill(admitted)
                if canvas:
                    self._run("canvas", self.canvas_step, canvas, self._keys(canvas, admitted, steps, self.C))
                if ar:
                    self._run("ar", self.causal.ar_step, ar, self._keys(ar, admitted, steps, 1))
            events.steps = steps
            scored = {s: i.params.logprobs for s, i in self.slots.info.items() if i.wants_scores}
            drafting = [s for s, i in sorted(self.slots.info.items()) if i.params.stream_drafts]
            events.blocks, events.counters = self.outputs.copy_out(self.slots, sorted(self.slots.info), scored,
                                                                   self.drafts, drafting, steps)
            t = self.slots
            events.steps_left = {s: self.budget.left(i.params, t.host_phase[s], t.host_n[s], t.host_emitted[s])
                                 for s, i in self.slots.info.items()}
            return events

    def warm_up(self) -> float:
        """Before serving, on a runner with no slots in use: runs a canvas step of one row and of two, with
        none, one or all of them scored at 2 alternatives a position (the variant every k > 1 shares), so
        that their state updates compile now (model/steps/compiled.py), then freezes compiling. Does
        nothing where the updates are not compiled. Returns the seconds it took."""
        update = self.canvas_step.update
        if not isinstance(update, CompiledUpdate) or update.compiled is None or self.batch_invariant:
            return 0.0
        assert not self.slots.info, "warm_up runs before any slot is admitted"
        start = time.perf_counter()
        prompt = tuple(range(1, 5))
        # dynamo specialises sizes 0 and 1: one row, several rows with one scored, and several with
        # several scored are each their own variant; one row first, so that the others compile with
        # sizes symbolic
        rows = min(2, self.slots.num_slots)
        kinds = [(None,), (2,)] + ([(None, None), (2, None), (2, 2)] if rows == 2 else [])
        for logprobs in kinds:
            news = tuple(NewSlot(s, prompt, DecodeParams(max_tokens=1, ignore_eos=True, logprobs=k), s)
                         for s, k in enumerate(logprobs))
            self.execute(Command(admit=news, max_steps=1))
            self.execute(Command(release=tuple(range(len(news))), max_steps=0))
        update.freeze()
        return time.perf_counter() - start

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
        for n in news:
            self.slots.info[n.slot] = SlotInfo(n.params, tuple(n.prompt))
        return slots

    def _keys(self, slots: list[int], admitted: list[int], steps: int, width: int) -> int:
        """Keys a row can read within the command: its length now (a new slot's: its prompt's) plus what
        the command can commit (a canvas every other step, or one AR token per step) plus its own width."""
        t = self.slots
        start = max(len(t.info[s].prompt) if s in admitted else t.host_length[s] for s in slots)
        growth = -(-steps // 2) * self.C if width == self.C else steps + 1
        return bucket(start + growth + width, self.kv.max_len)

    def plan(self, slots: list[int], kv_len: int):
        return plan_rows([self.slots.info[s] for s in slots], kv_len, self.family.uniform_noise)

    def _prefill(self, slots: list[int]) -> None:
        """The prompts of newly admitted `slots`, in one causal pass; on CUDA a graph's replay up to
        PREFILL_GRAPH_TOKENS (model/graphs.py), the prompts padded to its width."""
        t = self.slots
        infos = [t.info[s] for s in slots]
        longest = max(len(i.prompt) for i in infos)
        width = prefill_width(longest, self.kv.max_len)
        graphed = self.graphs is not None and self.observer is None and len(slots) * width <= PREFILL_GRAPH_TOKENS
        width = width if graphed else longest
        plan = self.plan(slots, width)
        pinned = self.device.type == "cuda"
        tokens = torch.zeros(len(slots), width, dtype=torch.int64, pin_memory=pinned)
        for row, info in enumerate(infos):
            tokens[row, : len(info.prompt)] = torch.tensor(info.prompt)
        host = (torch.tensor(slots, dtype=torch.int64, pin_memory=pinned),
                torch.tensor(list(plan.scored), dtype=torch.int64, pin_memory=pinned), tokens,
                torch.tensor([len(i.prompt) for i in infos], dtype=torch.int64, pin_memory=pinned),
                torch.tensor([[i.params.mode == m for m in ("diffusion", "linear_spec", "ar")] for i in infos],
                             dtype=torch.bool, pin_memory=pinned))
        step = lambda *inputs: self.causal.prefill(plan, *inputs)   # noqa: E731
        if graphed:
            self.graphs.run(("prefill", plan), step, *self.graphs.static_inputs(("prefill", plan), *host))
        else:
            step(*(h.to(self.device, non_blocking=True) for h in host))

    def _run(self, kind: str, step, slots: list[int], kv_len: int) -> None:
        plan = self.plan(slots, kv_len)
        if plan.drafting:   # the drafting rows' index, made outside the step: made inside on its first run, it
            self.drafts.rows(plan)   # would change a compiled update's guards between that run and the capture
        if self.graphs is None or self.observer is not None:
            idx = self.slots.device_index(slots)
            scored = self.slots.device_index(list(plan.scored))
            step(plan, idx, scored)
            return
        # what else changes a step's code: whether self-conditioning runs (off only to measure its cost)
        key = (kind, plan, getattr(self.canvas_step, "self_conditioning", None))
        idx, scored = self.graphs.index_inputs(key, slots, list(plan.scored))
        self.graphs.run(key, lambda i, s: step(plan, i, s), idx, scored)


def sampler_passes(device: str) -> VocabPasses:
    """The sampler's passes over the vocabulary: triton's on CUDA, torch's elsewhere."""
    if not str(device).startswith("cuda"):
        return TORCH_PASSES
    from model.kernels.vocab_stats import TRITON_PASSES

    return TRITON_PASSES
