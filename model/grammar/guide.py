"""The host side of constrained decoding on one rank (docs/spec.md 12): each constrained slot's llguidance
matcher, and before every step over its row, the check of what the last step revealed.

A row's text is valid while the grammar takes it from the committed end: the canvas's revealed run from
position 0 is checked left to right; its first token the grammar refuses is masked again (the next step
samples it anew), and the position after the valid run, the frontier, is the one whose candidates the
grammar limits (model/steps/env.py) and which the step reveals whatever its policy (model/steps/masked.py).
Positions past the frontier are sampled freely and checked when the run reaches them, so a canvas reveals in
parallel what the grammar lets through. A commit step's frontier is its last position, whose prediction
seeds the next canvas; an AR row's is its one token. A linear speculation draft's frontier is the position
after its seed; its verify is limited at every position of the draft's valid run, so each causal prediction
it accepts, and the next seed, is one the grammar allows. Every rank runs the same checks on the same tokens,
so their masks agree without a collective.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask
import torch

from model.grammar.compile import parser_limits
from model.phases import AR, COMMIT, DENOISE, DRAFT, VERIFY
from model.sampling.params import DecodeParams
from model.slots import SlotTable

# compiled grammars kept for reuse (a matcher's deep copy is cheap; building one compiles its grammar)
COMPILED_GRAMMARS = 64


class SlotGrammar:
    """One constrained slot: a matcher at the end of the slot's committed text, and what the last check saw."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: frozenset[int], ignore_eos: bool, words: int):
        self.matcher, self.eos, self.ignore_eos, self.words = matcher, eos, ignore_eos, words
        self.length: int | None = None   # the slot's written length at the last check (None: no check yet)
        self.emitted = 0                 # its emitted tokens at the last check (AR rows)
        self.canvas: list[int] = []      # the canvas as the last check left it: what a commit emits
        self.ended = False               # the grammar took an EOS: only EOS may follow (ignore_eos)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (after the committed text) the grammar takes; once the grammar is complete
        (an EOS taken, or a matcher that takes nothing more), only EOS."""
        complete = self.ended or self.matcher.is_stopped()   # a stopped matcher validates no EOS itself
        v = 0 if complete else self.matcher.validate_tokens(tokens)
        if not complete and not (v and tokens[v - 1] in self.eos):
            return v
        while v < len(tokens) and tokens[v] in self.eos:
            v += 1
        return v

    def ends_within(self, tokens: list[int]) -> bool:
        """Whether valid `tokens` hold an EOS that ends the request (the rest of its canvas is never emitted)."""
        return not self.ignore_eos and any(x in self.eos for x in tokens)

    def commit(self, tokens: list[int]) -> None:
        """The slot emitted `tokens` (valid: checked before): the matcher moves past them."""
        for x in tokens:
            self.ended = self.ended or x in self.eos
            if not self.ended:
                self.matcher.consume_token(x)

    def mask_after(self, prefix: list[int], out: np.ndarray) -> None:
        """The tokens the grammar allows after `prefix` (valid), as bits into out [words]."""
        self.masks_along(prefix, out[None], start=len(prefix))

    def masks_along(self, tokens: list[int], out: np.ndarray, start: int = 1) -> None:
        """out[k] [words]: the tokens the grammar allows after tokens[:start + k], for k < len(out) (tokens
        valid)."""
        taken = 0
        for k in range(len(out)):
            end = start + k
            done = self.ended or any(x in self.eos for x in tokens[:end])
            if not done:
                self.matcher.consume_tokens(tokens[taken:end])
                taken = end
                fill_next_token_bitmask(self.matcher, out, k)
                done = self.matcher.is_error() or not out[k].any()   # nothing allowed: end the text now
            if done:
                out[k] = 0
                for e in self.eos:
                    bit = 1 << (e & 31)
                    out[k, e >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit
        if taken:
            self.matcher.rollback(taken)


class GrammarGuide:
    def __init__(self, slots: SlotTable, load_tokenizer: Callable[[], llguidance.LLTokenizer] | None,
                 eos: list[int], mask_id: int | None):
        """load_tokenizer: the served tokenizer for llguidance, built on the first constrained request
        (None: this runner takes none)."""
        self.t, self.load_tokenizer = slots, load_tokenizer
        self.eos, self.mask_id = frozenset(eos), mask_id
        self.words = slots.grammar_bits.shape[-1]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.active: dict[int, SlotGrammar] = {}
        # uniform-noise canvases (DiffusionGemma): each slot's argmax canvas, the text a converging step emits
        self.argmax: torch.Tensor | None = None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        if self.load_tokenizer is None:
            raise ValueError("this runner was built without its tokenizer: it takes no constrained request")
        if self._tokenizer is None:
            self._tokenizer = self.load_tokenizer()
        if grammar not in self._compiled:
            self._compiled[grammar] = llguidance.LLMatcher(self._tokenizer, grammar, limits=parser_limits())
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return self._compiled[grammar].deep_copy()

    def admit(self, slots: list[int], params: list[DecodeParams]) -> None:
        """New slots: a constrained one's first prediction (the prefill's) is limited to what its grammar
        starts with."""
        mine = [(s, p) for s, p in zip(slots, params) if p.grammar is not None]
        for s, p in mine:
            self.active[s] = SlotGrammar(self.matcher(p.grammar.text), self.eos, p.ignore_eos, self.words)
        if mine:
            bits = np.zeros((len(mine), self.words), dtype=np.int32)
            for row, (s, _) in enumerate(mine):
                self.active[s].mask_after([], bits[row])
            self._write([s for s, _ in mine], [0] * len(mine), bits)

    def release(self, slots: list[int]) -> None:
        gone = [s for s in slots if self.active.pop(s, None) is not None]
        if gone:
            idx = self.t.device_index(gone)
            self.t.grammar_pos[idx] = -1
            self.t.grammar_valid[idx] = -1
            self.t.grammar_fixed[idx] = -1

    def check(self, slots: list[int]) -> set[int]:
        """Before a step over rows `slots`: each constrained one's text as the last step left it, checked;
        the first refused token masked again, the frontier and its allowed tokens set (one copy of the rows'
        state to the host and one back: a step with constrained rows waits for the host). Returns the slots
        whose step is limited at more than one position (a verify: model/steps/env.py)."""
        mine = [s for s in slots if s in self.active]
        if not mine:
            return set()
        if self.argmax is not None:
            self._check_uniform(mine)
            return set()
        t, C = self.t, self.t.C
        idx = t.device_index(mine)
        state = torch.cat([torch.stack([t.phase[idx], t.length[idx], t.emitted[idx], t.last_token[idx]], 1),
                           t.canvas[idx]], 1).tolist()
        width = self.t.grammar_bits.shape[1]
        pos, span, bits = [], [], np.zeros((len(mine), width, self.words), dtype=np.int32)
        phases, canvases = [], []
        for row, (s, (phase, length, emitted, last, *canvas)) in enumerate(zip(mine, state)):
            g = self.active[s]
            p, prefix, n = -1, [], 1
            if phase in (DRAFT, VERIFY):
                if emitted > g.emitted:   # the last verify emitted the head of the draft it checked
                    g.commit(canvas[:emitted - g.emitted])
                g.emitted = emitted
                if phase == DRAFT:   # the draft's position 1 follows its seed (drawn under the grammar)
                    p, prefix = 1, [last]
                else:   # every causal prediction along the draft's valid run, the next seed's included
                    n = g.valid_prefix(canvas)
                    # the seed was drawn under the grammar's mask: a run without it would verify unlimited
                    assert n >= 1, f"slot {s}: the draft's seed {canvas[0]} is outside its grammar"
                    g.masks_along(canvas, bits[row, :n])
                    p = 0
            elif phase == AR:
                if emitted > g.emitted:   # one token a step, the prefill's first
                    g.commit([last])
                g.emitted = emitted
                p = 0
            elif phase in (DENOISE, COMMIT):
                if g.length is not None and length > g.length:   # the canvas checked last was committed
                    g.commit(g.canvas)
                g.length = length
                end = canvas.index(self.mask_id) if self.mask_id in canvas else C
                v = g.valid_prefix(canvas[:end])
                if g.ends_within(canvas[:v]):
                    pass   # the request ends at that EOS: nothing after it is emitted
                elif v < end:   # the first refused token: masked again, sampled anew next step
                    canvas[v] = self.mask_id
                    phase, p, prefix = DENOISE, v, canvas[:v]
                elif end < C:
                    p, prefix = end, canvas[:end]
                elif phase == COMMIT:   # a valid canvas: its commit's last prediction seeds the next canvas
                    p, prefix = C - 1, canvas
                g.canvas = canvas
            if p >= 0 and phase != VERIFY:
                g.mask_after(prefix, bits[row, 0])
            pos.append(p)
            span.append(n)
            phases.append(phase)
            canvases.append(canvas)
        self._write(mine, pos, bits, span)
        dev = t.device
        t.phase.index_copy_(0, idx, torch.tensor(phases, dtype=torch.int64).to(dev))
        t.canvas.index_copy_(0, idx, torch.tensor(canvases, dtype=torch.int64).to(dev))
        return {s for s, n in zip(mine, span) if n > 1}

    def _check_uniform(self, mine: list[int]) -> None:
        """Uniform-noise canvases (DiffusionGemma): every position holds a token at every step, so the check
        reads the argmax canvas, the text a converging step would emit. Its valid run from position 0 is
        counted; the position after it (the frontier) is limited to the grammar's tokens; the canvas may
        converge only once the run is the whole text and the step keeps it. From the canvas's N-th step on,
        the valid run is pinned, so the frontier moves right every step and the canvas ends within C more."""
        t, C = self.t, self.t.C
        idx = t.device_index(mine)
        state = torch.cat([torch.stack([t.phase[idx], t.length[idx], t.n[idx], t.steps_limit[idx]], 1),
                           self.argmax[idx]], 1).tolist()
        pos, valid, done = [], [], []
        fixed = np.full((len(mine), C), -1, dtype=np.int64)
        bits = np.zeros((len(mine), self.words), dtype=np.int32)
        for row, (s, (phase, length, n, N, *argmax)) in enumerate(zip(mine, state)):
            g = self.active[s]
            if g.length is not None and length > g.length:   # the canvas checked last was committed
                g.commit(g.canvas)
            g.length = length
            p, v, complete = -1, 0, False
            if phase == DENOISE and argmax[0] >= 0:   # a fresh canvas has no argmax yet: nothing is valid
                v = g.valid_prefix(argmax)
                complete = v == C or g.ends_within(argmax[:v])
                if complete and v < C:   # the text ends at an EOS: the rest is never emitted
                    v = next(i for i, x in enumerate(argmax[:v]) if x in self.eos) + 1
            elif phase == COMMIT:
                v, complete = C, True
            if phase == DENOISE and not complete:
                p = v
                g.mask_after(argmax[:v], bits[row])
            if phase == DENOISE and n + 1 >= N:   # past N: the valid run stays
                fixed[row, :v] = argmax[:v]
            g.canvas = argmax
            pos.append(p)
            valid.append(v)
            done.append(complete)
        self._write(mine, pos, bits)
        dev = t.device
        t.grammar_valid.index_copy_(0, idx, torch.tensor(valid, dtype=torch.int64).to(dev))
        t.grammar_done.index_copy_(0, idx, torch.tensor(done, dtype=torch.bool).to(dev))
        t.grammar_fixed.index_copy_(0, idx, torch.from_numpy(fixed).to(dev))

    def _write(self, slots: list[int], pos: list[int], bits: np.ndarray, span: list[int] | None = None) -> None:
        """Each slot's first limited position, how many from it (default 1), and their allowed tokens: bits
        [n, words] (one position) or [n, width, words]."""
        t = self.t
        idx = t.device_index(slots)
        span = span or [1] * len(slots)
        bits = bits[:, None] if bits.ndim == 2 else bits[:, :max(span)]   # only the positions some row reads
        t.grammar_pos.index_copy_(0, idx, torch.tensor(pos, dtype=torch.int64).to(t.device))
        t.grammar_span.index_copy_(0, idx, torch.tensor(span, dtype=torch.int64).to(t.device))
        t.grammar_bits[idx, :bits.shape[1]] = torch.from_numpy(np.ascontiguousarray(bits)).to(t.device)
