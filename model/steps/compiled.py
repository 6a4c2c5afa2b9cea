"""A step kind's state update as one torch.compile'd function on CUDA.

After its forward and sampler a canvas step decides every phase for every row and writes the slots'
state, the outputs and the counters: about a hundred small ops, which inductor fuses into a handful of
kernels (no collective and no host read inside, so it compiles whole). A compile takes many seconds, so
a shard compiles before it serves: `Runner.warm_up` runs every graph of the closed set, whose plans need
four variants, then `freeze`s; a plan without a compiled variant then runs as written (the same results).
Should compiling fail, the update runs as written and says so once; the batch-invariant mode runs it as
written; DLLM_COMPILE_UPDATES=0 in the shards' environment turns compiling off. docs/design.md, "CUDA graphs".
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
