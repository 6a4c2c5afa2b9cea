"""A checkpoint's `config.json` and `generation_config.json` as typed, validated, immutable models.

The per-architecture constants (mask id, canvas length, vocabulary) are read here and nowhere else.
Loading never executes checkpoint code: `auto_map` entries are ignored, only fields are read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class RopeParameters(_Frozen):
    model_config = ConfigDict(extra="allow", frozen=True)

    rope_type: Literal["default", "yarn"] = "default"
    rope_theta: PositiveFloat
    factor: PositiveFloat | None = None
    original_max_position_embeddings: PositiveInt | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    llama_4_scaling_beta: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_type_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rope_type" not in data and "type" in data:
            data = {**data, "rope_type": data["type"]}
        return data

    @model_validator(mode="after")
    def _yarn_needs_fields(self) -> "RopeParameters":
        if self.rope_type == "yarn" and (self.factor is None or self.original_max_position_embeddings is None):
            raise ValueError("yarn rope_parameters need factor and original_max_position_embeddings")
        if self.llama_4_scaling_beta and self.original_max_position_embeddings is None:
            raise ValueError("llama_4_scaling_beta needs original_max_position_embeddings")
        return self


class NemotronLabsDiffusionConfig(_Frozen):
    """Nemotron-Labs-Diffusion (SPEC.md 2.1): a Ministral-3 backbone under `encoder.*` plus an untied
    `diffusion_head`, decoded by masked block diffusion over `block_size`-token canvases."""

    model_type: Literal["nemotron_labs_diffusion"]
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt | None = None
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: PositiveInt
    rms_norm_eps: PositiveFloat = 1e-5
    rope_parameters: RopeParameters
    attention_bias: Literal[False] = False
    mlp_bias: Literal[False] = False
    tie_word_embeddings: Literal[False] = False
    sliding_window: None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int]
    pad_token_id: int | None = None
    mask_token_id: int
    block_size: PositiveInt = 32
    dlm_paradigm: Literal["bidirectional"] = "bidirectional"
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", validation_alias="torch_dtype")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if "rope_parameters" not in data and ("rope_scaling" in data or "rope_theta" in data):  # pre-v5
                data["rope_parameters"] = {"rope_theta": data.get("rope_theta", 1e6), **(data.get("rope_scaling") or {})}
            if "dtype" in data and "torch_dtype" not in data:
                data["torch_dtype"] = data["dtype"]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "NemotronLabsDiffusionConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for name in ("mask_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} outside the vocabulary [0, {self.vocab_size})")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos_token_id={eos} outside the vocabulary [0, {self.vocab_size})")
        return self

    @property
    def family(self) -> str:
        return "nemotron-ld"

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    @property
    def canvas_length(self) -> int:
        return self.block_size

    def check_tensor_parallel(self, tp: int) -> None:
        """Raises ValueError naming the first field that cannot be split tp ways."""
        if tp < 1:
            raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")
        if self.vocab_size < tp:
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than tensor_parallel_size={tp}")

    def to_transformers(self):
        """The equivalent transformers `Ministral3Config` (the backbone reference and RoPE source)."""
        from transformers import Ministral3Config

        return Ministral3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_size,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters.model_dump(exclude_none=True),
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            tie_word_embeddings=False, sliding_window=None)


ModelConfig = NemotronLabsDiffusionConfig
SUPPORTED_MODEL_TYPES: dict[str, type[_Frozen]] = {"nemotron_labs_diffusion": NemotronLabsDiffusionConfig}


class GenerationDefaults(BaseModel):
    """`generation_config.json`: token ids plus any family-specific decoding knobs, kept as given
    (extra fields allowed) so per-server and per-request overrides can layer over them."""

    model_config = ConfigDict(extra="allow", frozen=True)

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_new_tokens: PositiveInt | None = None


def _format_validation_error(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(root)"
        parts.append(f"{field}: {e['msg']}")
    return f"{source}: " + "; ".join(parts)


def parse_model_config(data: dict[str, Any], source: str = "config.json") -> ModelConfig:
    model_type = data.get("model_type")
    cls = SUPPORTED_MODEL_TYPES.get(model_type)
    if cls is None:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ValueError(_format_validation_error(source, err)) from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return parse_model_config(json.loads(path.read_text()), str(path))


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    try:
        return GenerationDefaults.model_validate(json.loads(path.read_text()))
    except ValidationError as err:
        raise ValueError(_format_validation_error(str(path), err)) from None
