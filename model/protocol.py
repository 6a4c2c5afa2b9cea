"""The messages between the scheduler (workers/) and a shard's runner (model/).

Commands carry what changed (slots to free, new requests with their prompts), never histories; the
runner keeps every slot's state on its device. Events come back once per command.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from model.sampling.params import DecodeParams

# Positions per KV page. 16, as vLLM's default block: a cache hit is at most 15 tokens short of the shared
# prefix, and the attention kernel reads a page's keys as one run.
PAGE_SIZE = 16
# The most prompt positions one command prefills: a long prompt goes in chunks between the running
# requests' steps, so its arrival holds their next block back by a chunk's forward, not the prompt's.
# 2048: the widest prefill a CUDA graph of one row holds at the served shapes' budget, and about a
# dozen denoising steps' time of the 8B on an H100
PREFILL_CHUNK = 2048
# Commands the coordinator keeps at the shards at once (workers/coordinator.py): page tables must cover
# what this many commands write before the scheduler hears of their results.
COMMANDS_AHEAD = 2


@dataclass(frozen=True)
class NewSlot:
    slot: int
    prompt: tuple[int, ...]
    params: DecodeParams
    seed: int  # the request's seed, or one the scheduler drew: every rank uses the same
    cached: int = 0    # the prompt's first positions whose KV its pages already hold: its prefill starts here


@dataclass(frozen=True)
class PageRun:
    """Entries of a slot's page table in one layer group (model/attention.py: PagedKVCache), from page
    index `first` on; -1: none (the sink)."""
    group: int
    slot: int
    first: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class PrefillRun:
    """A slot's prompt positions [start, end) to prefill in a command's first step (a chunk of a long
    prompt: the slot starts decoding after the run that ends its prompt)."""
    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class Command:
    release: tuple[int, ...] = ()      # slots to free before anything else (finished or cancelled)
    admit: tuple[NewSlot, ...] = ()    # slots to prefill in this command's first step
    max_steps: int = 1                 # steps to run (a slot that finishes earlier idles until the end;
                                       # the scheduler sizes commands by the slots' steps_left)
    pages: tuple[PageRun, ...] = ()    # page table entries to set, after the releases
    # prompt chunks to prefill; an admitted slot without one prefills its prompt past its cached prefix whole
    prefill: tuple[PrefillRun, ...] = ()


@dataclass
class Draft:
    """A snapshot of a canvas being denoised (model/drafts.py), for a request that streams drafts."""

    start: int                 # the canvas's first absolute position
    step: int                  # denoising steps of the canvas so far
    tokens: list[int]          # [C]: the canvas (masked diffusion: the mask token where masked)
    known: list[bool]          # [C]: revealed (masked diffusion) or accepted at that step (DiffusionGemma)


@dataclass
class Block:
    """Tokens one slot emitted in one command (committed canvases, AR tokens, accepted drafts, in order),
    each with the scores its request asked for, captured from the distribution it was revealed/sampled
    from."""

    slot: int
    tokens: list[int]
    denoising_steps: int = 0                     # denoise (or draft) forwards of the canvases committed
    canvases: int = 0                            # canvases committed (linear speculation: verified drafts)
    logprobs: list[float] | None = None          # sampled-token logprob per token
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None       # [token][k]
    top_logprobs: list[list[float]] | None = None
    drafts: list[Draft] | None = None            # snapshots of canvases, oldest first (stream_drafts)
    length: int = 0                              # the slot's positions whose KV is written, at the command's end


@dataclass
class StepCounters:
    """docs/spec.md section 8, counted by the runner."""

    committed_tokens: int = 0
    denoising_steps: int = 0     # forwards over a canvas that are not commits
    canvas_positions: int = 0    # positions evaluated by those forwards
    canvases: int = 0            # commits
    forwards: int = 0            # every model forward (prefill, denoise, commit, AR, draft, verify)
    # batched forward passes (each reads every weight once; padding rows of a CUDA graph ride free):
    # forwards / passes is the rows a pass carries
    passes: int = 0

    def add(self, other: "StepCounters") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Events:
    blocks: list[Block] = field(default_factory=list)
    steps: int = 0
    counters: StepCounters = field(default_factory=StepCounters)
    # every occupied slot's bound on the steps it can still run (model/phases.py), as of the command's end
    steps_left: dict[int, int] = field(default_factory=dict)
    # the runner's wall time for the command, from its call to the end of the copy-out (host clock):
    # the coordinator's busy time of the shards, which shows what the control plane adds around them
    execute_s: float = 0.0
    # the runner's CUDA graph counts so far (model/graphs.py): steps run outside a graph and graphs
    # captured since its warm-up; None without graphs
    graphs: dict | None = None
