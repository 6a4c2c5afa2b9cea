"""A checkpoint directory, read once: its model config, its generation defaults, its family and what
follows from them (the renoise schedule's defaults, the step budget). `build_app` reads it and every
layer below (ingress, coordinator, shards) gets the same object; `RunnerArgs` is what a shard is asked
to build from it. Torch-free and picklable (it travels to Ray actors).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.config import (GenerationDefaults, ModelConfig, RenoiseDefaults, format_validation_error,
                          load_generation_defaults)
from model.families import FAMILIES, Family
from model.phases import StepBudget
from model.protocol import PREFILL_CHUNK


def parse_model_config(data: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """config.json's fields -> the typed config of its family; ValueError naming the field (or the
    unsupported model_type) otherwise."""
    model_type = data.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    try:
        return family.config.model_validate(data)
    except ValidationError as err:
        raise ValueError(format_validation_error(source, err)) from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return parse_model_config(json.loads(path.read_text()), str(path))


class Checkpoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    config: ModelConfig = Field(discriminator="model_type")
    generation: GenerationDefaults = GenerationDefaults()
    # the renoise schedule's defaults of a uniform-noise family (generation_config.json over
    # transformers' defaults); None for masked diffusion
    renoise: RenoiseDefaults | None = None

    @classmethod
    def read(cls, model_dir: str | Path) -> "Checkpoint":
        """config.json (required) and generation_config.json (optional) of `model_dir`."""
        config, generation = load_model_config(model_dir), load_generation_defaults(model_dir)
        renoise = RenoiseDefaults.from_generation(generation) if FAMILIES[config.model_type].uniform_noise else None
        return cls(path=str(model_dir), config=config, generation=generation, renoise=renoise)

    @property
    def family(self) -> Family:
        return FAMILIES[self.config.model_type]

    @property
    def quantization(self) -> str | None:
        """How the weights are stored quantized: config.json's quantization_config.quant_method
        ("compressed-tensors": FP8-dynamic, the one scheme read), or None."""
        scheme = self.config.quantization_config
        return None if scheme is None else scheme.quant_method

    def check_quantization(self, requested: str | None) -> None:
        """An application's `quantization` argument (vLLM's --quantization) against this checkpoint: None
        (the checkpoint's config decides) or its own method; a ValueError naming `quantization` otherwise.
        Weights are served as stored: an unquantized checkpoint is never quantized at load."""
        if requested is None or requested == self.quantization:
            return
        stored = f"quantized with {self.quantization!r}" if self.quantization else "not quantized"
        raise ValueError(f"quantization={requested!r}, but the checkpoint {self.path} is {stored} "
                         f"(its config.json's quantization_config decides; leave quantization unset)")

    def cache_salt(self, dtype: str | None) -> bytes:
        """What, besides the token ids, a KV page's content depends on: the model, its dtype and how it is
        quantized (the prefix cache's address salt, the same in every replica of one deployment)."""
        return f"{Path(self.path).name}|{self.config.model_type}|{dtype}|{self.quantization}".encode()

    @property
    def budget(self) -> StepBudget:
        """What a runner of this checkpoint bounds a request's remaining steps by (model/phases.py)."""
        return self.family.step_budget(self.config.canvas_length, self.renoise)


class RunnerArgs(BaseModel):
    """What one tensor-parallel rank builds its runner from (model.runner.Runner.from_args)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: Checkpoint
    num_slots: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    dtype: Literal["float32", "bfloat16", "float16", "float64"] | None = None   # None: the checkpoint's
    device: str = "cpu"
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    max_steps_per_command: int = Field(64, ge=1)
    batch_invariant: bool = False
    # the KV pool in positions (pages of model.protocol.PAGE_SIZE) of each layer group; None: on CUDA what
    # gpu_memory_utilization leaves (model/kv_budget.py), elsewhere as many as every slot at max_model_len takes
    kv_cache_tokens: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    prefill_chunk: int = Field(PREFILL_CHUNK, ge=1)   # the scheduler's (how far a sliding group's tables run)

    @classmethod
    def read(cls, model_dir: str | Path, **fields) -> "RunnerArgs":
        """RunnerArgs of the checkpoint in `model_dir` (read here) and `fields`."""
        return cls(checkpoint=Checkpoint.read(model_dir), **fields)
