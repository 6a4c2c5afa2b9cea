"""One rank's executor of batch commands (SPEC.md sections 1, 3, 5, 6).

Every slot has a phase; one step runs one forward per width group (prefill rows; canvas-wide rows:
denoise, commit, draft, verify; one-token AR rows), then each phase's sampler, then moves phases on.
All per-slot tensors (canvas, scores, sampling parameters, KV) live on the device in slot-indexed
buffers; the host keeps a mirror of phases and lengths that every rank updates identically.
A step reads its few decisions (converged flags, AR tokens, accepted drafts) in one small copy at
its end; tokens and scores of emitted blocks are copied out once per command.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.attention import KVCache, LayeredKVCache, step_context
from model.config import RenoiseDefaults
from model.graphs import CanvasGraphs, device_context, keys_for
from model.parallel import reductions as R
from model.protocol import Block, Command, Events, NewSlot, StepCounters
from model.renoise_canvases import RenoiseCanvases
from model.sampling.filters import mask_token, scale_and_filter
from model.sampling.logprobs import ScoreBuffer, token_scores
from model.sampling.noise import gumbel
from model.sampling.params import DecodeParams
from model.sampling.reveal import POLICY_IDS, reveal

PREFILL, DENOISE, COMMIT, AR, DRAFT, VERIFY = "prefill", "denoise", "commit", "ar", "draft", "verify"
CANVAS_PHASES = (DENOISE, COMMIT, DRAFT, VERIFY)


@dataclass
class SlotState:
    params: DecodeParams
    prompt: tuple[int, ...]
    phase: str = PREFILL
    length: int = 0          # valid KV positions: prompt + committed
    draws: int = 0           # random draws so far: the noise counter
    n: int = 0               # denoise steps of the current canvas
    emitted: int = 0         # tokens emitted so far
    pending: list[int] = field(default_factory=list)   # AR tokens of the block being built
    accepted: int = 0        # linear speculation: tokens accepted by the last verify

    @property
    def temperature(self) -> float:
        return self.params.effective_temperature

    @property
    def wants_scores(self) -> bool:
        return self.params.logprobs is not None


class Runner:
    def __init__(self, model, num_slots: int, max_model_len: int, device: torch.device | str = "cpu",
                 cuda_graphs: bool | None = None, renoise_defaults: RenoiseDefaults | None = None):
        cfg = model.config
        self.model, self.tp, self.device = model, model.tp, torch.device(device)
        self.C, self.mask_id = cfg.canvas_length, cfg.mask_token_id   # no mask token: uniform-noise family
        self.eos_ids = cfg.eos_token_ids
        self.num_slots = num_slots
        dtype = next(model.parameters()).dtype
        # + C: a verify may write scratch KV past the budget's last token
        if hasattr(model, "kv_layer_shapes"):
            self.kv = LayeredKVCache(model.kv_layer_shapes, num_slots, max_model_len + self.C, dtype, self.device)
        else:
            layers, kv_heads, head_dim = model.kv_shape
            self.kv = KVCache(layers, num_slots, max_model_len + self.C, kv_heads, head_dim, dtype, self.device)
        self.window = getattr(model, "sliding_window", None)
        self.max_model_len = max_model_len
        S, C, dev = num_slots, self.C, self.device
        self.canvas = torch.full((S, C), self.mask_id or 0, dtype=torch.int64, device=dev)
        self.block_tokens = torch.zeros(S, C, dtype=torch.int64, device=dev)
        self.last_token = torch.zeros(S, dtype=torch.int64, device=dev)
        self.canvas_scores = ScoreBuffer(S, C, dev)   # reveal-time scores of the canvas being denoised
        self.block_scores = ScoreBuffer(S, C, dev)    # scores of the block being emitted
        self.seed_scores = ScoreBuffer(S, 1, dev)     # linear speculation: score of the next seed
        self.temperature = torch.zeros(S, device=dev)
        self.top_k = torch.zeros(S, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(S, device=dev)
        self.tau = torch.ones(S, device=dev)
        self.gamma = torch.ones(S, device=dev)
        self.policy = torch.zeros(S, dtype=torch.int64, device=dev)
        self.seed = torch.zeros(S, dtype=torch.int64, device=dev)
        self.steps_limit = torch.ones(S, dtype=torch.int64, device=dev)
        self.slots: dict[int, SlotState] = {}
        self.renoise = None
        if cfg.family == "diffusion-gemma":
            self.renoise = RenoiseCanvases(self, renoise_defaults or RenoiseDefaults(), cfg.hidden_size, dtype)
        on_cuda = self.device.type == "cuda"
        # the self-conditioning input is not a graph input yet: DiffusionGemma runs eagerly
        use_graphs = (on_cuda if cuda_graphs is None else cuda_graphs) and self.renoise is None
        self.graphs = CanvasGraphs(model, self.kv, self.C) if use_graphs else None

    # ---- commands -------------------------------------------------------------------------------
    def execute(self, cmd: Command) -> Events:
        for slot in cmd.release:
            self.slots.pop(slot, None)
        for new in cmd.admit:
            self._admit(new)
        events = Events()
        while events.steps < cmd.max_steps and self.slots:
            blocks = self._step(events.counters)
            events.steps += 1
            if blocks:
                events.blocks = self._copy_out(blocks)
                break
        return events

    def _admit(self, new: NewSlot) -> None:
        p = new.params
        if not 0 <= new.slot < self.num_slots or new.slot in self.slots:
            raise ValueError(f"slot {new.slot} is not free")
        if len(new.prompt) + p.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(new.prompt)}) + max_tokens ({p.max_tokens}) > max_model_len")
        self.slots[new.slot] = SlotState(params=p, prompt=tuple(new.prompt))
        s = new.slot
        self.temperature[s] = p.effective_temperature
        self.top_k[s], self.top_p[s] = p.top_k, p.top_p
        p.check_family(self.model.config.family)
        self.tau[s], self.gamma[s] = p.threshold, p.reveal_entropy_bound
        self.policy[s] = POLICY_IDS[p.policy]
        self.seed[s] = new.seed
        self.steps_limit[s] = self.renoise.admit(s, p) if self.renoise else p.steps_for(self.C)

    # ---- one step -------------------------------------------------------------------------------
    def _step(self, counters: StepCounters) -> list[tuple[int, list[int]]]:
        groups = {phase: [s for s, st in sorted(self.slots.items()) if st.phase == phase]
                  for phase in (PREFILL, *CANVAS_PHASES, AR)}
        reads: list[tuple[torch.Tensor, object]] = []   # small device results, read once at the end
        if groups[PREFILL]:
            self._prefill(groups[PREFILL], reads, counters)
        canvas_rows = [s for phase in CANVAS_PHASES for s in groups[phase]]
        if canvas_rows:
            self._canvas_step(canvas_rows, reads, counters)
        if groups[AR]:
            self._ar_step(groups[AR], reads, counters)
        blocks: list[tuple[int, list[int]]] = []
        if reads:
            flat = torch.cat([t.reshape(-1).to(torch.int64) for t, _ in reads]).tolist()
            at = 0
            for tensor, apply in reads:
                k = tensor.numel()
                apply(flat[at: at + k], blocks)
                at += k
        return blocks

    def _forward(self, slots: list[int], tokens: torch.Tensor, starts: list[int], lengths: list[int],
                 causal: list[bool], soft: torch.Tensor | None = None) -> torch.Tensor:
        width = tokens.shape[1]
        for s, n in zip(starts, lengths):
            assert 0 < n <= width and s + n <= self.kv.max_len, (s, n, width)
        meta = self._host([slots, starts, lengths, [int(c) for c in causal]])
        if self.graphs is not None and width == self.C:
            return self.graphs.forward(meta, tokens, starts)
        ctx, positions = device_context(self.kv, meta.to(self.device, non_blocking=True), width,
                                        keys_for(starts, width, self.kv.max_len), self.window)
        with step_context(ctx), torch.inference_mode():
            if self.renoise:
                return self.model(tokens, positions, soft)
            return self.model(tokens, positions)

    def _host(self, values, dtype=torch.int64) -> torch.Tensor:
        """A host tensor that copies to the device without a sync (pinned when the device is a GPU)."""
        return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _dev(self, values, dtype=torch.int64) -> torch.Tensor:
        return self._host(values, dtype).to(self.device, non_blocking=True)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.model.compute_logits(hidden).float()
        mask_token(x, self.mask_id, self.model.vocab_start)
        return x

    def _rows(self, slots: list[int]) -> torch.Tensor:
        return self._dev(slots)

    def _filter_args(self, slots: list[int], idx: torch.Tensor) -> dict:
        """top_k / top_p arguments of the sampler filters: None where no row asks (work skipped)."""
        states = [self.slots[s] for s in slots]
        kmax = max(st.params.top_k for st in states)
        use_p = any(st.params.top_p < 1 for st in states)
        return {"top_k": self.top_k[idx] if kmax else None, "top_k_max": kmax,
                "top_p": self.top_p[idx] if use_p else None}

    def _filtered(self, slots: list[int], idx: torch.Tensor, logits: torch.Tensor):
        """(unscaled, scaled) with each row's temperature and filters."""
        return scale_and_filter(logits, self.temperature[idx], self.model.vocab_start, self.tp,
                                **self._filter_args(slots, idx))

    def _choose(self, slots: list[int], idx: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        """argmax(scaled + Gumbel) for sampling rows, argmax(scaled) for greedy ones: [R, P] global ids."""
        states = [self.slots[s] for s in slots]
        if any(st.temperature > 0 for st in states):
            counter = self._dev([st.draws for st in states])
            g = gumbel(self.seed[idx], counter, scaled.shape[1], self.model.vocab_start, scaled.shape[-1])
            sampling = (self.temperature[idx] > 0).view(-1, 1, 1)
            # filtered (-inf) entries stay -inf whatever the noise: never a NaN that argmax could pick
            scaled = torch.where(sampling & torch.isfinite(scaled), scaled + g, scaled)
            for st in states:
                st.draws += 1
        return R.argmax(scaled, self.model.vocab_start, self.tp)

    def _scores(self, slots: list[int], scaled: torch.Tensor, tokens: torch.Tensor):
        """Scores for the rows that asked (and only them); None when no row asked."""
        rows = [i for i, s in enumerate(slots) if self.slots[s].wants_scores]
        if not rows:
            return None
        k = max(self.slots[slots[i]].params.logprobs for i in rows)
        pick = self._dev(rows)
        return rows, token_scores(scaled[pick], tokens[pick], k, self.model.vocab_start, self.tp)

    # ---- causal next-token prediction: prefill, commit, AR -------------------------------------
    def _next_token(self, slots: list[int], logits: torch.Tensor):
        """logits [R, Vr] of the next position -> (tokens [R], scores or None)."""
        idx = self._rows(slots)
        _, scaled = self._filtered(slots, idx, logits[:, None, :])
        tokens = self._choose(slots, idx, scaled)
        return tokens[:, 0], self._scores(slots, scaled, tokens)

    def _prefill(self, slots: list[int], reads, counters: StepCounters) -> None:
        prompts = [self.slots[s].prompt for s in slots]
        width = max(len(p) for p in prompts)
        tokens = torch.zeros(len(slots), width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)  # host-side staging, one copy below
        lengths = [len(p) for p in prompts]
        tokens = tokens.pin_memory() if self.device.type == "cuda" else tokens
        hidden = self._forward(slots, tokens.to(self.device, non_blocking=True), [0] * len(slots), lengths,
                               [True] * len(slots))
        last = hidden[torch.arange(len(slots), device=self.device), self._dev(lengths) - 1]
        counters.forwards += len(slots)
        for s, n in zip(slots, lengths):
            self.slots[s].length = n
        if self.renoise:  # a uniform-noise canvas needs no prediction from the prefix
            self.renoise.start(slots)
            return
        self._after_causal(slots, self._logits(last), reads, counters)

    def _after_causal(self, slots: list[int], logits: torch.Tensor, reads, counters: StepCounters) -> None:
        """A causal pass ended at each slot's `length`: its next-token prediction starts what follows."""
        tokens, scores = self._next_token(slots, logits)
        idx = self._rows(slots)
        by_mode: dict[str, list[int]] = {}
        for i, s in enumerate(slots):
            by_mode.setdefault(self.slots[s].params.mode, []).append(i)
        for mode, rows in by_mode.items():
            pick = self._dev(rows)
            sub = idx[pick]
            sub_slots = [slots[i] for i in rows]
            if mode == "diffusion":
                self._new_canvas(sub_slots, sub, tokens[pick], scores, rows)
            elif mode == "linear_spec":
                self.last_token[sub] = tokens[pick]
                self._store_scores(self.seed_scores, sub_slots, rows, scores, index=0)
                for s in sub_slots:
                    self.slots[s].phase = DRAFT
            else:  # ar: the token is emitted now, fed next step
                self.last_token[sub] = tokens[pick]
                for s, row in zip(sub_slots, rows):
                    self._store_scores(self.block_scores, [s], [row], scores, index=len(self.slots[s].pending))
                reads.append((tokens[pick], self._ar_read(sub_slots, counters)))

    def _store_scores(self, buf: ScoreBuffer, slots: list[int], rows: list[int], scores, index: int) -> None:
        """Scores of the single predicted position of `rows` (indices into the scores' batch)."""
        if scores is None:
            return
        scored_rows, (lp, rank, tv, ti) = scores
        for s, r in zip(slots, rows):
            if r not in scored_rows:
                continue
            j = scored_rows.index(r)
            sl, at = self._dev([s]), self._dev([index])
            buf.write_at(sl, at, lp[j, :1], rank[j, :1], None if tv is None else tv[j, :1],
                         None if ti is None else ti[j, :1])

    def _new_canvas(self, slots: list[int], idx: torch.Tensor, seed_tokens: torch.Tensor, scores,
                    rows: list[int]) -> None:
        canvas = torch.full((len(slots), self.C), self.mask_id, dtype=torch.int64, device=self.device)
        seeded = [self.slots[s].params.seed_first_position for s in slots]
        if any(seeded):
            first = torch.where(self._dev(seeded, torch.bool), seed_tokens, self.mask_id)
            canvas[:, 0] = first
            self._store_scores(self.canvas_scores, [s for s, f in zip(slots, seeded) if f],
                               [r for r, f in zip(rows, seeded) if f], scores, index=0)
        self.canvas[idx] = canvas
        for s in slots:
            st = self.slots[s]
            st.phase, st.n = DENOISE, 0

    # ---- canvas-wide rows -----------------------------------------------------------------------
    def _canvas_step(self, slots: list[int], reads, counters: StepCounters) -> None:
        states = [self.slots[s] for s in slots]
        idx = self._rows(slots)
        causal = [st.phase in (COMMIT, VERIFY) for st in states]
        tokens = self.canvas[idx]
        starts = [st.length for st in states]
        soft = self.renoise.soft[idx] if self.renoise else None
        hidden = self._forward(slots, tokens, starts, [self.C] * len(slots), causal, soft)
        counters.forwards += len(slots)
        by_phase: dict[str, list[int]] = {}
        for i, st in enumerate(states):
            by_phase.setdefault(st.phase, []).append(i)
        denoise = self.renoise.denoise if self.renoise else self._denoise
        handlers = {DENOISE: denoise, COMMIT: self._commit, DRAFT: self._draft, VERIFY: self._verify}
        for phase, rows in by_phase.items():
            pick = self._dev(rows)
            handlers[phase]([slots[i] for i in rows], hidden[pick], reads, counters)

    def _denoise(self, slots: list[int], hidden: torch.Tensor, reads, counters: StepCounters) -> None:
        """SPEC.md 3.1-3.7 for each row: candidates, confidence, reveal, convergence."""
        idx = self._rows(slots)
        states = [self.slots[s] for s in slots]
        x = self._logits(hidden)                                        # [R, C, Vr]
        unscaled, scaled = self._filtered(slots, idx, x)
        x0 = self._choose(slots, idx, scaled)                           # [R, C]
        vs = self.model.vocab_start
        confidence = R.value_at(unscaled, x0, vs, self.tp) - R.logsumexp(unscaled, self.tp)
        canvas = self.canvas[idx]
        masked = canvas == self.mask_id
        present = sorted({st.params.policy for st in states})
        entropy = R.entropy(unscaled, self.tp) if "entropy_bound" in present else None
        n = self._dev([st.n for st in states])
        revealed = reveal(self.policy[idx], present, masked, n, self.steps_limit[idx],
                          confidence=torch.where(masked, confidence, -torch.inf), entropy=entropy,
                          tau=self.tau[idx], gamma=self.gamma[idx])
        canvas = torch.where(revealed, x0, canvas)
        self.canvas[idx] = canvas
        scores = self._scores(slots, scaled, x0)
        if scores is not None:
            rows, (lp, rank, tv, ti) = scores
            pick = self._dev(rows)
            self.canvas_scores.write(idx[pick], revealed[pick], lp, rank, tv, ti)
        counters.denoising_steps += len(slots)
        counters.canvas_positions += len(slots) * self.C
        for st in states:
            st.n += 1
        still_masked = canvas == self.mask_id
        converged = ~still_masked.any(-1) | (n + 1 >= self.steps_limit[idx])
        early = [st.params.eos_early_stop and not st.params.ignore_eos for st in states]
        if any(early):
            eos = torch.isin(canvas, self._dev(list(self.eos_ids)))
            clean_eos = (eos & (torch.cumsum(still_masked.long(), -1) == 0)).any(-1)
            converged |= clean_eos & self._dev(early, torch.bool)

        def apply(flags, _blocks):
            for st, done in zip(states, flags):
                if done:
                    st.phase = COMMIT
        reads.append((converged, apply))

    def _commit(self, slots: list[int], hidden: torch.Tensor, reads, counters: StepCounters) -> None:
        """The canvas's causal pass wrote its KV; emit it and seed the next canvas."""
        idx = self._rows(slots)
        self.block_tokens[idx] = self.canvas[idx]
        self.block_scores.copy_rows(idx, self.canvas_scores, idx)
        counters.canvases += len(slots)
        counters.committed_tokens += len(slots) * self.C
        steps = [self.slots[s].n for s in slots]
        for s in slots:
            self.slots[s].length += self.C
        if self.renoise:
            self.renoise.start(slots)
        else:
            self._after_causal(slots, self._logits(hidden[:, -1]), reads, counters)
        tokens = self.block_tokens[idx]

        def apply(flat, blocks):
            for i, (s, n_steps) in enumerate(zip(slots, steps)):
                row = flat[i * self.C:(i + 1) * self.C]
                if self.mask_id in row:  # denoising stopped at a clean EOS: the rest is discarded
                    row = row[: row.index(self.mask_id)]
                blocks.append((s, row, n_steps))
                self.slots[s].emitted += len(row)
        reads.append((tokens, apply))

    def _draft(self, slots: list[int], hidden: torch.Tensor, reads, counters: StepCounters) -> None:
        """Linear speculation, SPEC.md 5.2: one bidirectional pass over [seed, MASK x (C-1)]."""
        idx = self._rows(slots)
        draft = R.argmax(self._logits(hidden), self.model.vocab_start, self.tp)
        draft[:, 0] = self.last_token[idx]
        self.canvas[idx] = draft
        counters.denoising_steps += len(slots)
        counters.canvas_positions += len(slots) * self.C
        for s in slots:
            self.slots[s].phase = VERIFY

    def _verify(self, slots: list[int], hidden: torch.Tensor, reads, counters: StepCounters) -> None:
        """SPEC.md 5.3: accept the draft's prefix that causal greedy decoding agrees with."""
        idx = self._rows(slots)
        states = [self.slots[s] for s in slots]
        logits = self._logits(hidden)
        _, scaled = self._filtered(slots, idx, logits)
        pred = R.argmax(scaled, self.model.vocab_start, self.tp)           # [R, C]
        draft = self.canvas[idx]
        agree = torch.cumprod((draft[:, 1:] == pred[:, :-1]).long(), -1).sum(-1)
        budget = self._dev([min(self.C, st.params.max_tokens - st.emitted) for st in states])
        accepted = torch.minimum(1 + agree, budget)
        self.block_tokens[idx] = draft
        scores = self._scores(slots, scaled, pred)
        if scores is not None:
            rows, (lp, rank, tv, ti) = scores
            pick = self._dev(rows)
            sl = idx[pick]
            # block position 0 is the seed, scored when it was predicted; j >= 1 come from pred[j - 1]
            shift = lambda t: None if t is None else torch.cat([t[:, :1], t[:, :-1]], 1)  # noqa: E731
            self.block_scores.write(sl, torch.ones_like(draft[pick], dtype=torch.bool), shift(lp), shift(rank),
                                    shift(tv), shift(ti))
            self.block_scores.copy_position(sl, 0, self.seed_scores, 0)
            last = accepted[pick] - 1
            ar = torch.arange(len(rows), device=self.device)
            self.seed_scores.write_at(sl, torch.zeros_like(last), lp[ar, last], rank[ar, last],
                                      None if tv is None else tv[ar, last], None if ti is None else ti[ar, last])
        self.last_token[idx] = torch.gather(pred, 1, (accepted - 1)[:, None]).squeeze(1)
        counters.canvases += len(slots)

        def apply(flat, blocks):
            for s, st, n_acc in zip(slots, states, flat):
                st.length += n_acc
                st.emitted += n_acc
                counters.committed_tokens += n_acc
                st.phase = DRAFT
                blocks.append((s, ("draft", n_acc), 1))
        reads.append((accepted, apply))

    # ---- AR rows --------------------------------------------------------------------------------
    def _ar_step(self, slots: list[int], reads, counters: StepCounters) -> None:
        idx = self._rows(slots)
        states = [self.slots[s] for s in slots]
        hidden = self._forward(slots, self.last_token[idx][:, None], [st.length for st in states],
                               [1] * len(slots), [True] * len(slots))
        counters.forwards += len(slots)
        for st in states:
            st.length += 1
        tokens, scores = self._next_token(slots, self._logits(hidden[:, 0]))
        self.last_token[idx] = tokens
        for i, (s, st) in enumerate(zip(slots, states)):
            self._store_scores(self.block_scores, [s], [i], scores, index=len(st.pending))
        reads.append((tokens, self._ar_read(slots, counters)))

    def _ar_read(self, slots: list[int], counters: StepCounters):
        def apply(flat, blocks):
            for s, token in zip(slots, flat):
                st = self.slots[s]
                st.pending.append(token)
                st.phase = AR
                p = st.params
                stop = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
                if stop or len(st.pending) == self.C or st.emitted + len(st.pending) >= p.max_tokens:
                    blocks.append((s, list(st.pending), 0))
                    counters.committed_tokens += len(st.pending)
                    st.emitted += len(st.pending)
                    st.pending = []
        return apply

    # ---- results --------------------------------------------------------------------------------
    def _copy_out(self, emitted) -> list[Block]:
        """The one copy of a command's tokens and scores to the host (one transfer per buffer)."""
        verified = [(s, tokens[1]) for s, tokens, _ in emitted if isinstance(tokens, tuple)]
        scored = [s for s, _, _ in emitted if s in self.slots and self.slots[s].wants_scores]
        rows = sorted({s for s, _ in verified} | set(scored))
        host = {}
        if rows:
            idx = self._dev(rows)
            b = self.block_scores
            tensors = [self.block_tokens[idx], b.logprob[idx], b.rank[idx], b.top_values[idx], b.top_ids[idx]]
            host = dict(zip(rows, zip(*[t.cpu() for t in tensors])))
        out = []
        for s, tokens, steps in emitted:
            if isinstance(tokens, tuple):  # a verify: the accepted prefix of the draft
                tokens = host[s][0][: tokens[1]].tolist()
            block = Block(slot=s, tokens=tokens, denoising_steps=steps)
            if s in scored and tokens:
                n, k = len(tokens), self.slots[s].params.logprobs
                _, lp, rank, tv, ti = host[s]
                block.logprobs, block.ranks = lp[:n].tolist(), rank[:n].tolist()
                block.top_ids, block.top_logprobs = ti[:n, :k].tolist(), tv[:n, :k].tolist()
            out.append(block)
        return out
