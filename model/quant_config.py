"""config.json's `quantization_config`: compressed-tensors' FP8-dynamic scheme, read and checked, and which
of a model's linear modules it quantizes.

The one scheme served is compressed-tensors' FP8_DYNAMIC preset as a saved checkpoint holds it: weights
float 8-bit, symmetric, per output channel, static (`weight_scale` [out, 1]); input activations float
8-bit, symmetric, per token, dynamic; an `ignore` list of module names (exact, or `re:` + a regex matched
at the name's start). Every other scheme is refused when config.json is read, each unsupported field and
its value named (docs/spec.md 2.3). Field names and defaults are compressed-tensors', so an absent field
reads as that library reads it. Torch-free.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEME = ("compressed-tensors FP8-dynamic (float8 weights with one static scale per output channel, "
          "float8 input activations with one dynamic scale per token)")


class QuantizationArgs(BaseModel):
    """The fields of compressed-tensors' QuantizationArgs that change the arithmetic (observers only
    calibrate, so they are not read)."""
    model_config = ConfigDict(extra="ignore", frozen=True)

    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    group_size: int | None = None
    strategy: str | None = None
    block_structure: list[int] | None = None
    dynamic: bool | str = False
    actorder: bool | str | None = None
    scale_dtype: str | None = None

    @property
    def resolved_strategy(self) -> str:
        """compressed-tensors' inference when strategy is absent: group_size None -> tensor, -1 -> channel."""
        if self.strategy is not None:
            return self.strategy
        return "tensor" if self.group_size is None else "channel" if self.group_size == -1 else "group"

    def problems(self, path: str, strategy: str, dynamic: bool) -> list[str]:
        wanted = {"type": "float", "num_bits": 8, "symmetric": True, "strategy": strategy, "dynamic": dynamic}
        found = {"type": self.type, "num_bits": self.num_bits, "symmetric": self.symmetric,
                 "strategy": self.resolved_strategy, "dynamic": self.dynamic}
        out = [_unsupported(f"{path}.{k}", found[k], repr(v)) for k, v in wanted.items() if found[k] != v]
        if self.group_size not in (None, -1):
            out.append(_unsupported(f"{path}.group_size", self.group_size, "null"))
        if self.block_structure is not None:
            out.append(_unsupported(f"{path}.block_structure", self.block_structure, "null"))
        if self.actorder not in (None, False):
            out.append(_unsupported(f"{path}.actorder", self.actorder, "null"))
        if self.scale_dtype not in (None, "bfloat16", "float16", "float32",
                                    "torch.bfloat16", "torch.float16", "torch.float32"):
            out.append(_unsupported(f"{path}.scale_dtype", self.scale_dtype, "a 16- or 32-bit float"))
        return out


class QuantizationScheme(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    targets: list[str]
    weights: QuantizationArgs | None = None
    input_activations: QuantizationArgs | None = None
    output_activations: dict[str, Any] | None = None
    format: str | None = None

    def problems(self, path: str) -> list[str]:
        out = []
        if self.targets != ["Linear"]:
            out.append(_unsupported(f"{path}.targets", self.targets, "['Linear']"))
        for name, strategy, dynamic in (("weights", "channel", False), ("input_activations", "token", True)):
            args = getattr(self, name)
            if args is None:
                out.append(_unsupported(f"{path}.{name}", None, f"float8 per {strategy}"))
            else:
                out += args.problems(f"{path}.{name}", strategy, dynamic)
        if self.output_activations is not None:
            out.append(_unsupported(f"{path}.output_activations", self.output_activations, "null"))
        if self.format not in (None, "float-quantized"):
            out.append(_unsupported(f"{path}.format", self.format, "'float-quantized'"))
        return out


class QuantizationConfig(BaseModel):
    """config.json's `quantization_config` (compressed-tensors' QuantizationConfig), FP8-dynamic only."""
    model_config = ConfigDict(extra="ignore", frozen=True)

    quant_method: str
    format: str = "fakequant"
    quantization_status: str = "initialized"
    config_groups: dict[str, QuantizationScheme | list[str]]
    kv_cache_scheme: dict[str, Any] | None = None
    ignore: list[str] | None = Field(default_factory=list)
    sparsity_config: dict[str, Any] | None = None
    transform_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> "QuantizationConfig":
        out = []
        for name, wanted in (("quant_method", "compressed-tensors"), ("format", "float-quantized"),
                             ("quantization_status", "compressed")):
            if getattr(self, name) != wanted:
                out.append(_unsupported(name, getattr(self, name), repr(wanted)))
        if self.kv_cache_scheme is not None:
            out.append(_unsupported("kv_cache_scheme", self.kv_cache_scheme, "null (an unquantized KV cache)"))
        for name in ("sparsity_config", "transform_config"):
            if getattr(self, name):
                out.append(_unsupported(name, getattr(self, name), "none"))
        if not self.config_groups:
            out.append(_unsupported("config_groups", self.config_groups, "one group or more"))
        for group, scheme in self.config_groups.items():
            if isinstance(scheme, list):  # a preset name with its targets: never what a saved checkpoint holds
                out.append(_unsupported(f"config_groups.{group}", scheme, "a scheme with weights and activations"))
            else:
                out += scheme.problems(f"config_groups.{group}")
        for i, pattern in enumerate(self.ignore or ()):
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as err:
                    out.append(f"ignore[{i}]={pattern!r} is not a regular expression ({err})")
        if out:
            raise ValueError("; ".join(out) + f". Supported: {SCHEME}")
        return self

    def ignores(self, module: str) -> bool:
        """Whether checkpoint module `module` stays unquantized (compressed-tensors' match_name: an exact
        name, or `re:` + a regex matched at the start)."""
        return any(re.match(p[3:], module) is not None if p.startswith("re:") else p == module
                   for p in self.ignore or ())


def _unsupported(field: str, value: Any, supported: str) -> str:
    return f"{field}={value!r} is not supported (expected {supported})"


@dataclass(frozen=True)
class QuantScope:
    """Which linear modules under checkpoint module path `prefix` hold FP8 weights. A model builds its
    layers with the scope of their checkpoint path: `scope / "self_attn"`, then
    `scope.fp8("q_proj", "k_proj", "v_proj")` for a module fused from those. Every `Linear` the scheme
    does not ignore is quantized (its only target is `Linear`); no config: nothing is."""

    config: QuantizationConfig | None = None
    prefix: str = ""

    def __truediv__(self, name: str) -> "QuantScope":
        return QuantScope(self.config, f"{self.prefix}.{name}" if self.prefix else name)

    def name(self, module: str) -> str:
        return f"{self.prefix}.{module}" if self.prefix else module

    def fp8(self, *modules: str) -> bool:
        """Whether the checkpoint's linear modules `modules` (fused into one of ours: all or none) are FP8;
        a ValueError naming them if the ignore list splits them."""
        if self.config is None:
            return False
        names = [self.name(m) for m in modules]
        kept = [n for n in names if self.config.ignores(n)]
        if kept and len(kept) < len(names):
            raise ValueError(f"quantization_config.ignore keeps {', '.join(kept)} unquantized but not "
                             f"{', '.join(n for n in names if n not in kept)}; this server fuses them into one "
                             f"matmul, so they must be quantized alike")
        return not kept
