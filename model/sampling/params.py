"""Per-request decoding parameters (SPEC.md sections 3, 5 and 6), validated once at the boundary.

Errors name the parameter: pydantic's ValidationError carries the field as its `loc`, and
cross-field conflicts raise ValueErrors that name every field involved.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Mode = Literal["diffusion", "ar", "linear_spec"]
RevealPolicy = Literal["threshold", "low_confidence", "leftmost", "entropy_bound"]
MAX_LOGPROBS = 20


class DecodeParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = "diffusion"
    # None: 0 (greedy) for linear_spec, which is greedy by definition; 1.0 otherwise (OpenAI's default).
    temperature: float | None = Field(None, ge=0, le=100)
    top_k: int = Field(0, ge=0, description="0 disables")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_tokens: int = Field(16, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    policy: RevealPolicy = "threshold"
    threshold: float = Field(0.9, gt=0, le=1, description="tau of the threshold policy")
    entropy_bound: float | None = Field(None, gt=0, description="gamma: the entropy_bound policy (default 0.1), "
                                        "or DiffusionGemma's acceptance bound (default: generation_config.json)")
    max_denoising_steps: int | None = Field(None, ge=1, description="N; None: the canvas length (masked "
                                            "diffusion) or generation_config.json (DiffusionGemma)")
    # DiffusionGemma's renoise sampler (SPEC.md 4); None: the checkpoint's generation_config.json
    t_min: float | None = Field(None, ge=0)
    t_max: float | None = Field(None, gt=0)
    stability_threshold: int | None = Field(None, ge=0)
    confidence_threshold: float | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed_first_position: bool = Field(True, description="SPEC 3(a): canvas position 0 from the AR prediction")
    eos_early_stop: bool = Field(True, description="SPEC 3(b): stop denoising at an EOS with no mask before it")
    stream_drafts: bool = Field(False, description="snapshot the canvas being denoised every draft_every steps")
    draft_every: int = Field(4, ge=1, description="denoising steps between two drafts of a canvas")

    @model_validator(mode="after")
    def _consistent(self) -> "DecodeParams":
        if self.mode == "linear_spec" and self.temperature not in (None, 0):
            raise ValueError(f"mode='linear_spec' is greedy only; temperature={self.temperature} must be 0")
        if self.t_min is not None and self.t_max is not None and self.t_max <= self.t_min:
            raise ValueError(f"t_max={self.t_max} must be > t_min={self.t_min}")
        return self

    def check_family(self, family: str) -> None:
        """Raises ValueError naming the parameter this model family cannot honour."""
        if family == "diffusion-gemma" and self.mode != "diffusion":
            raise ValueError(f"mode={self.mode!r} is not supported by DiffusionGemma (uniform-noise diffusion "
                             "only); use mode='diffusion'")

    @property
    def effective_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.mode == "linear_spec" else 1.0

    @property
    def reveal_entropy_bound(self) -> float:
        """gamma of the masked-diffusion entropy_bound reveal policy (SPEC.md 3.5)."""
        return 0.1 if self.entropy_bound is None else self.entropy_bound

    def steps_for(self, canvas_length: int) -> int:
        """N for this request's canvases."""
        return min(self.max_denoising_steps or canvas_length, canvas_length)
