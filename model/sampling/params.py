"""Per-request decoding parameters (docs/spec.md sections 3, 5 and 6): the one declaration of every
decoding option. A field marked `Settable` is also set by a request's `diffusion` object and/or the
server's arguments; both derive their fields from here (`settable_fields`), so bounds cannot drift.

Errors name the parameter: pydantic's ValidationError carries the field as its `loc` (a cross-field
conflict: the later field, its message naming both). Every value means in the shards' int64 / fp32
tensors what it means here (finite; bounded where a larger value means nothing more; no nonzero value
that fp32 rounds to 0; t_max > t_min in fp32), so no request can fail a step, which would fail every
request in the batch.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

Mode = Literal["diffusion", "ar", "linear_spec"]
RevealPolicy = Literal["threshold", "low_confidence", "leftmost", "entropy_bound"]
MAX_LOGPROBS = 20
MAX_COUNT = 2**31 - 1     # steps, top-k: beyond any canvas or vocabulary
MAX_TEMPERATURE = 100.0
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits divided by less overflow fp32 to inf,
# and a softmax of infs is NaN, so such a "nearly greedy" request would otherwise get garbage.
MIN_TEMPERATURE = 1e-5
MAX_ENTROPY = 1e4         # nats: above C * log V of any canvas and vocabulary (256 * log 2^32 = 5678)
FLOAT_FIELDS = ("temperature", "top_p", "threshold", "entropy_bound", "t_min", "t_max", "confidence_threshold")


class ParamError(ValueError):
    """A request that cannot be served as asked; `param` names the field at fault as an OpenAI request
    spells it (dotted, e.g. "diffusion.mode"; a completion's names: the ingress renames "max_tokens" and
    "prompt" for chat), None when no one field is. The ingress answers it with a 400 naming the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Settable:
    """Who sets a DecodeParams field besides the engine: a request's `diffusion` object (deployments/
    protocol.py) and, with `server`, the server's arguments (deployments/args.py), as its default."""

    server: bool = False


PER_REQUEST = Settable()          # the request's `diffusion` object
SERVER_DEFAULT = Settable(True)   # that, and a server-wide default


class Grammar(BaseModel):
    """A structured-output constraint as the engine takes it (docs/spec.md 12): the llguidance grammar that
    model/grammar/compile.py checked, and the request field it came from, which an error names."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    field: str = "response_format"


def fp32(x: float) -> float:
    """x as an fp32 tensor holds it (|x| within fp32's range)."""
    return struct.unpack("f", struct.pack("f", x))[0]


class DecodeParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    mode: Annotated[Mode, SERVER_DEFAULT] = Field("diffusion", description="diffusion (default), ar (causal "
                                                  "decoding with the same weights), or linear_spec (greedy)")
    top_k: int = Field(0, ge=0, le=MAX_COUNT, description="0 disables")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_tokens: int = Field(16, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    policy: Annotated[RevealPolicy, SERVER_DEFAULT] = Field("threshold", description="which masked positions a "
                                                            "denoising step reveals")
    threshold: Annotated[float, SERVER_DEFAULT] = Field(0.9, gt=0, le=1, description="tau of the threshold policy")
    entropy_bound: Annotated[float | None, SERVER_DEFAULT] = Field(
        None, gt=0, le=MAX_ENTROPY, description="gamma: the entropy_bound policy (default 0.1), or DiffusionGemma's "
        "acceptance bound (default: generation_config.json)")
    max_denoising_steps: Annotated[int | None, SERVER_DEFAULT] = Field(
        None, ge=1, le=MAX_COUNT, description="N; None: the canvas length (masked diffusion) or "
        "generation_config.json (DiffusionGemma)")
    # DiffusionGemma's renoise sampler (docs/spec.md 4); None: the checkpoint's generation_config.json
    t_min: Annotated[float | None, SERVER_DEFAULT] = Field(None, ge=0, le=MAX_TEMPERATURE)
    t_max: Annotated[float | None, SERVER_DEFAULT] = Field(None, gt=0, le=MAX_TEMPERATURE)
    stability_threshold: Annotated[int | None, SERVER_DEFAULT] = Field(None, ge=0, le=MAX_COUNT)
    confidence_threshold: Annotated[float | None, SERVER_DEFAULT] = Field(None, ge=0, le=MAX_ENTROPY)
    # None: 0 (greedy) for linear_spec, which is greedy by definition; 1.0 otherwise (OpenAI's default).
    # A uniform-noise family scales its schedule by it (schedule_scale). Declared after t_min and t_max,
    # so that its check sees them.
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed_first_position: Annotated[bool, PER_REQUEST] = Field(
        True, description="docs/spec.md 3(a): canvas position 0 from the AR prediction")
    eos_early_stop: Annotated[bool, PER_REQUEST] = Field(
        True, description="docs/spec.md 3(b): stop denoising at an EOS with no mask before it")
    stream_drafts: Annotated[bool, PER_REQUEST] = Field(
        False, description="snapshot the canvas being denoised every draft_every steps")
    draft_every: Annotated[int, PER_REQUEST] = Field(4, ge=1, description="denoising steps between two drafts of "
                                                     "a canvas")
    # structured output: every token the request emits keeps its text a prefix of the grammar's language
    grammar: Grammar | None = None

    @field_validator(*FLOAT_FIELDS)
    @classmethod
    def _not_zero_in_fp32(cls, v: float | None) -> float | None:
        if v and fp32(v) == 0:
            raise ValueError(f"{v!r} is 0 in fp32, the precision the engine computes in")
        return v

    @field_validator("temperature")
    @classmethod
    def _greedy_below_min(cls, v: float | None) -> float | None:
        return 0.0 if v is not None and v < MIN_TEMPERATURE else v

    @field_validator("temperature")
    @classmethod
    def _greedy_if_linear_spec(cls, v: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("mode") == "linear_spec" and v not in (None, 0):
            raise ValueError(f"mode='linear_spec' is greedy only; temperature={v} must be 0")
        return v

    @field_validator("t_max")
    @classmethod
    def _above_t_min(cls, v: float | None, info: ValidationInfo) -> float | None:
        t_min = info.data.get("t_min")
        if v is not None and t_min is not None and fp32(v) <= fp32(t_min):
            raise ValueError(f"t_max={v} must be > t_min={t_min}")
        return v

    @field_validator("temperature")
    @classmethod
    def _keeps_the_schedule(cls, v: float | None, info: ValidationInfo) -> float | None:
        """A scaled schedule (schedule_scale) still has t_max > t_min in fp32: a temperature so small that
        both ends round to one fp32 value would leave no schedule."""
        t_min, t_max = info.data.get("t_min"), info.data.get("t_max")
        if v and t_min is not None and t_max is not None and fp32(v * t_max) <= fp32(v * t_min):
            raise ValueError(f"temperature={v} scales the schedule t_min={t_min}, t_max={t_max} to ends that are "
                             "equal in fp32, the precision the engine computes in")
        return v

    @property
    def effective_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.mode == "linear_spec" else 1.0

    @property
    def schedule_scale(self) -> float:
        """What a uniform-noise family (DiffusionGemma) multiplies its temperature schedule's t_min and t_max
        by: the request's temperature, and 1 (the schedule as set) when it gives none or 0. There a
        canvas starts as uniform noise and is renoised at any temperature, so 0 cannot mean "no noise";
        it means "reproducible": the noise then comes from a fixed seed unless the request gives one
        (workers/scheduler.py)."""
        return self.temperature or 1.0

    @property
    def reveal_entropy_bound(self) -> float:
        """gamma of the masked-diffusion entropy_bound reveal policy (docs/spec.md 3.5)."""
        return 0.1 if self.entropy_bound is None else self.entropy_bound

    def steps_for(self, canvas_length: int) -> int:
        """N for this request's canvases."""
        return min(self.max_denoising_steps or canvas_length, canvas_length)


def settable_fields(server: bool = False) -> dict[str, tuple[Any, FieldInfo]]:
    """`create_model` field definitions of the Settable fields, in declaration order: with `server`, the
    server-default ones with their defaults; else every one, optional (None: not given), for a request's
    `diffusion` object. Types, bounds and descriptions are DecodeParams'; its cross-field checks run when
    the values reach DecodeParams."""
    fields = {}
    for name, info in DecodeParams.model_fields.items():
        settable = [m for m in info.metadata if isinstance(m, Settable)]
        if not settable or (server and not settable[0].server):
            continue
        bounds = [m for m in info.metadata if not isinstance(m, Settable)]
        constrained = Annotated[(info.annotation, *bounds)] if bounds else info.annotation
        if server:
            fields[name] = (constrained, Field(info.default, description=info.description))
        else:
            fields[name] = (Optional[constrained], Field(None, description=info.description))
    return fields
