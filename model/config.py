"""A checkpoint's `config.json` and `generation_config.json` as typed, validated, immutable models.

The per-architecture constants (mask id, canvas length, vocabulary) are read here and nowhere else.
Loading never executes checkpoint code: `auto_map` entries are ignored, only fields are read.
A quantized checkpoint's `quantization_config` is read by model/quant_config.py (FP8-dynamic only).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, model_validator

from model.quant_config import QuantizationConfig, QuantScope


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _check_token_ids(cfg, names: tuple[str, ...]) -> None:
    """Each named id, and every EOS id, inside the vocabulary; a ValueError naming the field if not."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < cfg.vocab_size:
            raise ValueError(f"{name}={value} outside the vocabulary [0, {cfg.vocab_size})")
    for eos in cfg.eos_token_ids:
        if not 0 <= eos < cfg.vocab_size:
            raise ValueError(f"eos_token_id={eos} outside the vocabulary [0, {cfg.vocab_size})")


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


class _CheckpointConfig(_Frozen):
    """What every family's config shares: `eos_token_id` is one id or a list in config.json, and
    `quantization_config` (absent: every weight in `dtype`)."""

    eos_token_id: int | list[int]
    quantization_config: QuantizationConfig | None = None

    @property
    def quant_scope(self) -> QuantScope:
        """Which linear modules hold FP8 weights, from the checkpoint's root module path."""
        return QuantScope(self.quantization_config)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)


class NemotronLabsDiffusionConfig(_CheckpointConfig):
    """Nemotron-Labs-Diffusion (docs/spec.md 2.1): a Ministral-3 backbone under `encoder.*` plus an untied
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
        _check_token_ids(self, ("mask_token_id", "bos_token_id", "pad_token_id"))
        return self

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

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


class LayerRope(_Frozen):
    """One layer type's RoPE: `default` (full rotary) or `proportional` (Gemma-4 full layers: only the
    first `partial_rotary_factor` of each half is rotated, at frequencies of the whole head_dim)."""

    rope_type: Literal["default", "proportional"] = "default"
    rope_theta: PositiveFloat
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    factor: PositiveFloat = 1.0


SLIDING, FULL = "sliding_attention", "full_attention"


class DiffusionGemmaConfig(_CheckpointConfig):
    """DiffusionGemma (docs/spec.md 2.2): one Gemma-4 MoE text backbone run causally (prefill, commit) and
    bidirectionally (denoise), tied embeddings, decoded by uniform-noise diffusion over
    `canvas_length`-token canvases. config.json nests the backbone under `text_config`; it is read
    flattened (the vision tower is not served). Full-attention layers take their head_dim and KV heads
    from `per_layer_config` (what transformers writes) or else `global_head_dim` (default 512) and
    `num_global_key_value_heads`, exactly as transformers resolves them."""

    model_type: Literal["diffusion_gemma"]
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt = 256
    global_head_dim: PositiveInt = 512
    num_global_key_value_heads: PositiveInt | None = None
    attention_k_eq_v: bool = True
    per_layer_config: dict[int, dict[str, Any]] = Field(default_factory=dict)
    layer_types: tuple[Literal["sliding_attention", "full_attention"], ...] | None = None
    sliding_window: PositiveInt = 512
    rope_parameters: dict[Literal["sliding_attention", "full_attention"], LayerRope] = Field(
        default_factory=lambda: {SLIDING: LayerRope(rope_theta=10_000.0),
                                 FULL: LayerRope(rope_type="proportional", partial_rotary_factor=0.25,
                                                 rope_theta=1_000_000.0)})
    hidden_activation: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    max_position_embeddings: PositiveInt = 131_072
    rms_norm_eps: PositiveFloat = 1e-6
    final_logit_softcapping: PositiveFloat = 30.0
    num_experts: PositiveInt
    top_k_experts: PositiveInt
    moe_intermediate_size: PositiveInt
    attention_bias: Literal[False] = False
    use_bidirectional_attention: Literal["vision"] | None = None
    tie_word_embeddings: Literal[True] = True
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] = 1
    pad_token_id: int | None = 0
    canvas_length: PositiveInt = 256
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", validation_alias="torch_dtype")

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("text_config: a DiffusionGemma config.json nests its backbone in text_config")
        if text.get("use_bidirectional_attention") == "all":
            # transformers then halves the window and makes the encoder bidirectional: not a text server
            raise ValueError("text_config.use_bidirectional_attention='all' is not supported (causal encoder expected)")
        flat = {k: v for k, v in text.items() if k != "model_type"}
        for key in ("canvas_length", "model_type", "quantization_config"):
            if key in data:
                flat[key] = data[key]
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype"):
            if key in data and key not in flat:
                flat[key] = data[key]
        if flat.get("dtype") is not None and "torch_dtype" not in flat:
            flat["torch_dtype"] = flat["dtype"]
        for key in ("rope_parameters", "layer_types", "global_head_dim", "sliding_window"):
            if flat.get(key) is None:
                flat.pop(key, None)
        return flat

    @model_validator(mode="after")
    def _consistent(self) -> "DiffusionGemmaConfig":
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"top_k_experts={self.top_k_experts} > num_experts={self.num_experts}")
        for i in range(self.num_hidden_layers):
            if self.num_attention_heads % self.layer_num_kv_heads(i):
                raise ValueError(f"layer {i}: num_attention_heads={self.num_attention_heads} is not a multiple "
                                 f"of its {self.layer_num_kv_heads(i)} KV heads")
        _check_token_ids(self, ("bos_token_id", "pad_token_id"))
        return self

    @property
    def mask_token_id(self) -> None:
        """No mask token: a canvas starts as uniform random tokens and is renoised uniformly (SPEC 4)."""
        return None

    @property
    def layer_type_list(self) -> tuple[str, ...]:
        """transformers' default when absent: five sliding layers then one full; the last layer full."""
        types = list(self.layer_types or [SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers)])
        types[-1] = FULL
        return tuple(types)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_type_list[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        if self.is_sliding(layer):
            return self.head_dim
        return self._override(layer).get("head_dim", self.head_dim if self.per_layer_config else self.global_head_dim)

    def layer_num_kv_heads(self, layer: int) -> int:
        if self.is_sliding(layer):
            return self.num_key_value_heads
        if self.per_layer_config:
            return self._override(layer).get("num_key_value_heads", self.num_key_value_heads)
        if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def _override(self, layer: int) -> dict[str, Any]:
        return self.per_layer_config.get(layer, {})

    def check_tensor_parallel(self, tp: int) -> None:
        """Raises ValueError naming the first field that cannot be split tp ways. KV heads fewer than
        tp are replicated (each rank holds the one its query heads read), so they need tp % kv == 0."""
        if tp < 1:
            raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
        for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")
        for i in range(self.num_hidden_layers):
            kv = self.layer_num_kv_heads(i)
            if (kv % tp) if kv >= tp else (tp % kv):
                raise ValueError(f"layer {i}: {kv} KV heads cannot be split or replicated "
                                 f"tensor_parallel_size={tp} ways")
        if self.vocab_size < tp:
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than tensor_parallel_size={tp}")


class RenoiseDefaults(_Frozen):
    """DiffusionGemma's decoding knobs (docs/spec.md 4) from `generation_config.json`, with transformers'
    defaults (`DiffusionGemmaGenerationConfig._get_default_generation_params`) for absent or null keys;
    per-server and per-request overrides layer over these."""

    max_denoising_steps: PositiveInt = 48
    t_min: float = Field(0.4, ge=0)
    t_max: float = Field(0.8, ge=0)
    entropy_bound: PositiveFloat = 0.1
    stability_threshold: int = Field(1, ge=0)
    confidence_threshold: float = Field(0.005, ge=0, description="0 forces exactly max_denoising_steps steps")

    @model_validator(mode="after")
    def _schedule(self) -> "RenoiseDefaults":
        if self.t_max <= self.t_min:
            raise ValueError(f"t_max={self.t_max} must be > t_min={self.t_min}")
        return self

    @classmethod
    def from_generation(cls, gen: "GenerationDefaults") -> "RenoiseDefaults":
        extra = gen.model_extra or {}
        data = {k: extra[k] for k in ("max_denoising_steps", "t_min", "t_max", "stability_threshold",
                                      "confidence_threshold") if extra.get(k) is not None}
        sampler = extra.get("sampler_config")
        if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
            data["entropy_bound"] = sampler["entropy_bound"]
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ValueError(format_validation_error("generation_config.json", err)) from None


ModelConfig = NemotronLabsDiffusionConfig | DiffusionGemmaConfig


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


def format_validation_error(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(root)"
        parts.append(f"{field}: {e['msg']}")
    return f"{source}: " + "; ".join(parts)


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    try:
        return GenerationDefaults.model_validate(json.loads(path.read_text()))
    except ValidationError as err:
        raise ValueError(format_validation_error(str(path), err)) from None
