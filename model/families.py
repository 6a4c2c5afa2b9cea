"""The model families this server decodes, in one table: `config.json`'s model_type -> its Family.

A family is a config class (model/config.py), a model class, the step that denoises its canvases
(model/steps), the decoding modes its weights support, and whether its canvases are uniform noise
with DiffusionGemma's schedule knobs (docs/spec.md 4) or masked (docs/spec.md 3). Adding a family is its own
files plus one entry here.

Torch-free: the ingress and the scheduler read it. The torch classes are named by import path and
resolved where torch is already loaded (the loader, the runner), as vLLM's model registry does.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from model.config import DiffusionGemmaConfig, NemotronLabsDiffusionConfig, RenoiseDefaults
from model.sampling.params import ParamError
from model.phases import StepBudget


@dataclass(frozen=True)
class Family:
    name: str                     # what logs and tiny checkpoints call it
    title: str                    # what error messages call it
    config: type                  # the pydantic class that reads its config.json
    model_class: str              # "module:Class" of one tensor-parallel rank's model (model/protocol.py)
    canvas_step: str              # "module:Class" of its canvas-wide step kind (model/steps)
    modes: tuple[str, ...]        # decoding modes of its weights (docs/spec.md 3, 5)
    # uniform-noise canvases (docs/spec.md 4): schedule knobs from generation_config.json, a per-step
    # temperature from the schedule (it always samples), and a request's last canvas emitted when it
    # converges, without the commit step whose KV nothing would read
    uniform_noise: bool = False
    # the modes whose steps constrain a request's text to a grammar (docs/spec.md 12)
    constrained_modes: tuple[str, ...] = ()

    def resolve(self, path: str) -> type:
        module, _, name = path.partition(":")
        return getattr(importlib.import_module(module), name)

    def step_budget(self, canvas_length: int, renoise: RenoiseDefaults | None) -> StepBudget:
        """How many steps a request can still take (model/phases.py) for a runner of this family."""
        if not self.uniform_noise:
            return StepBudget(canvas_length)
        return StepBudget(canvas_length, renoise.max_denoising_steps, last_canvas_commits=False)

    def check(self, params) -> None:
        """ParamError naming `diffusion.mode` if this family's weights cannot decode in the request's mode, or
        the constraint's field if its steps cannot constrain that mode."""
        if params.mode not in self.modes:
            supported = " or ".join(f"mode={m!r}" for m in self.modes)
            raise ParamError(f"mode={params.mode!r} is not supported by {self.title}; use {supported}",
                                 "diffusion.mode")
        if params.grammar is not None and params.mode not in self.constrained_modes:
            field = params.grammar.field
            served = f" (it is in mode {' or '.join(map(repr, self.constrained_modes))})" if self.constrained_modes else ""
            raise ParamError(f"{field}: structured output is not implemented for {self.title} in mode="
                             f"{params.mode!r}{served}", field)


FAMILIES: dict[str, Family] = {
    "nemotron_labs_diffusion": Family(
        "nemotron-ld", "Nemotron-Labs-Diffusion", NemotronLabsDiffusionConfig, "model.nemotron_ld:NemotronLabsDiffusionModel",
        "model.steps.masked:MaskedCanvasStep", modes=("diffusion", "ar", "linear_spec"),
        constrained_modes=("diffusion", "ar", "linear_spec")),
    "diffusion_gemma": Family(
        "diffusion-gemma", "DiffusionGemma", DiffusionGemmaConfig, "model.diffusion_gemma:DiffusionGemmaForBlockDiffusion",
        "model.steps.renoise:RenoiseCanvasStep", modes=("diffusion",), uniform_noise=True,
        constrained_modes=("diffusion",)),
}
