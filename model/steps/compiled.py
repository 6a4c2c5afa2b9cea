"""A step kind's state update as one torch.compile'd function on CUDA.

After its forward and sampler, a canvas step decides every phase for every row and writes the slots'
state, the command's outputs and its counters: about a hundred gathers, wheres, scatters and small
reductions over [B, C] tensors, each its own kernel of a few microseconds in the step's CUDA graph.
Compiled (inductor, dynamic shapes, no graph break allowed) they are a handful of fused kernels. The
update holds no collective and no host read, so it compiles whole; the forward, the sampler's vocabulary
passes and the all-reduces stay outside it.

An update compiles on its first call with a new kind of plan (one row or several; scores or none):
15-40 s on the H200 with a cold cache (inductor's on-disk cache makes a restart compile less). A served
step must not stall that long, so a shard compiles before it serves: `Runner.warm_up` runs every CUDA
graph of the closed set (model/graphs.py) once, whose plans need four variants (one row and several,
scored and not), and then `freeze`s: from then on a plan with no compiled update (an eager step's exact
plan) runs it as written (the same results). A compiled masked step computes every reveal policy and
the early stop for all rows (each row keeps its own), and k comes from the scores' shape, so the
variants serve every mix of options.
Without a warm-up (the in-process Engine, tests) every new kind of plan compiles on first use, up to
dynamo's limit of variants per function (8), which freezes it the same way.

Should compiling fail, the update runs as written from then on, and says so once in the log.
Batch-invariant mode runs it as written (its ordered scans are triton kernels of their own).
`DLLM_COMPILE_UPDATES=0` in the shards' environment turns compiling off.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from model.batch_invariant import enabled as batch_invariant_enabled

log = logging.getLogger("dllm.compiled")
RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


def compile_updates_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("DLLM_COMPILE_UPDATES", "1") != "0"


class CompiledUpdate:
    """update(*args) through torch.compile while it works; as written in batch-invariant mode, off CUDA or
    after a compile failure."""

    def __init__(self, update: Callable[..., None], on: bool, backend: str = "inductor"):
        self.update = update
        self.name = getattr(update, "__qualname__", repr(update))
        self.compiled = torch.compile(update, dynamic=True, fullgraph=True, backend=backend) if on else None
        self.frozen = False
        self.check_capture = on and torch.cuda.is_available()

    def freeze(self) -> None:
        """From now on compile nothing: plans with a compiled update use it, others run as written."""
        self.frozen = True

    def __call__(self, *args) -> None:
        if self.compiled is None or batch_invariant_enabled():
            return self.update(*args)
        try:
            # never compile while a CUDA graph is being captured (inductor reads values on the host):
            # a step's capture reuses what its eager first run compiled, or runs as written
            if self.frozen or (self.check_capture and torch.cuda.is_current_stream_capturing()):
                with torch.compiler.set_stance("eager_on_recompile"):
                    return self.compiled(*args)
            return self.compiled(*args)
        except RECOMPILE_LIMIT:   # dynamo's limit of variants (raised before running): keep those compiled
            log.info("%s: dynamo's limit of compiled variants reached; new plans run as written", self.name)
            self.freeze()
            return self.update(*args)
        except torch._dynamo.exc.TorchDynamoException as err:
            # raised while tracing or compiling, before anything ran (an error from running the update
            # propagates: running it again would apply its writes twice)
            log.warning("could not compile %s (%s: %s); running it as written", self.name, type(err).__name__, err)
            self.compiled = None
            return self.update(*args)
