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
    entropy_bound: float = Field(0.1, gt=0, description="gamma of the entropy_bound policy")
    max_denoising_steps: int | None = Field(None, ge=1, description="N; None means the canvas length")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed_first_position: bool = Field(True, description="SPEC 3(a): canvas position 0 from the AR prediction")
    eos_early_stop: bool = Field(True, description="SPEC 3(b): stop denoising at an EOS with no mask before it")

    @model_validator(mode="after")
    def _consistent(self) -> "DecodeParams":
        if self.mode == "linear_spec" and self.temperature not in (None, 0):
            raise ValueError(f"mode='linear_spec' is greedy only; temperature={self.temperature} must be 0")
        return self

    @property
    def effective_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.mode == "linear_spec" else 1.0

    def steps_for(self, canvas_length: int) -> int:
        """N for this request's canvases."""
        return min(self.max_denoising_steps or canvas_length, canvas_length)
