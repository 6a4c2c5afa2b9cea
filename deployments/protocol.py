"""The OpenAI-compatible wire format (pydantic v2): requests and responses (errors: deployments/errors.py).

Requests forbid unknown fields, so a misspelt option is a 400 that names it; a JSON `null` means
"not given" (the field's default). Numbers must be finite (Python's json reads NaN and Infinity) and
strings valid Unicode (JSON's \ud800 escapes decode to lone surrogates, which no tokenizer or UTF-8
encoder takes), so neither reaches the engine or an error message. `decode_params(defaults)` turns a
request plus the server's defaults into the engine's `DecodeParams`, raising `ParamError` (a
ValueError) that names the field.
Responses are plain models shaped like OpenAI's (checked against the `openai` client's types).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer
from pydantic import ValidationInfo, model_validator

from deployments.errors import validation_error_param
from model.sampling.params import MAX_LOGPROBS, DecodeParams, Mode, ParamError, RevealPolicy

# ----------------------------------------------------------------------------------------- requests


def _unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {err.start}") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class DiffusionOptions(_Strict):
    """Per-request overrides of the server's diffusion defaults (SPEC.md sections 3 and 5)."""

    mode: Mode | None = None
    policy: RevealPolicy | None = None
    threshold: float | None = Field(None, gt=0, le=1)
    entropy_bound: float | None = Field(None, gt=0)
    max_denoising_steps: int | None = Field(None, ge=1)
    seed_first_position: bool | None = None
    eos_early_stop: bool | None = None
    # DiffusionGemma's renoise sampler (SPEC.md 4); unset: the checkpoint's generation_config.json
    t_min: float | None = Field(None, ge=0)
    t_max: float | None = Field(None, gt=0)
    stability_threshold: int | None = Field(None, ge=0)
    confidence_threshold: float | None = Field(None, ge=0)
    # provisional streaming: snapshots of the canvas being denoised, every draft_every denoising steps
    stream_drafts: bool | None = None
    draft_every: int | None = Field(None, ge=1)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text
    temperature: float | None = Field(None, ge=0, le=2)  # None: DecodeParams' per-mode default
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    stop_token_ids: list[int] | None = None
    user: Text | None = None  # accepted, ignored
    diffusion: DiffusionOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n={v} is not supported; only n=1")
        return v

    @property
    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _decode_params(self, defaults: dict, max_tokens: int, logprobs: int | None,
                       logprobs_field: str) -> DecodeParams:
        values = {k: v for k, v in defaults.items() if v is not None}
        if self.diffusion is not None:
            values |= self.diffusion.model_dump(exclude_none=True)
        given = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "logprobs": logprobs,
                 "top_k": None if self.top_k is None else max(self.top_k, 0),
                 "stop_token_ids": None if self.stop_token_ids is None else tuple(self.stop_token_ids)}
        values |= {k: v for k, v in given.items() if v is not None}
        values |= {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        rename = {f: f"diffusion.{f}" for f in DiffusionOptions.model_fields} | {"logprobs": logprobs_field}
        try:
            params = DecodeParams(**values)
        except ValidationError as err:
            raise ParamError(*validation_error_param(err, rename)) from None
        if params.stream_drafts and not self.stream:
            raise ParamError("diffusion.stream_drafts needs stream: true (drafts are sent between the streamed "
                             "chunks)", "diffusion.stream_drafts")
        if params.stream_drafts and params.mode != "diffusion":
            raise ParamError(f"diffusion.stream_drafts needs mode 'diffusion' (got {params.mode!r}: no canvas "
                             "is denoised)", "diffusion.stream_drafts")
        return params


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[int]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and not all(isinstance(x, int) for x in v):
            if len(v) != 1:
                raise ValueError(f"batch prompts are not supported: send one prompt per request (got {len(v)})")
            v = v[0]  # ["text"] or [[ids]]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v

    def decode_params(self, defaults: dict) -> DecodeParams:
        return self._decode_params(defaults, self.max_tokens, self.logprobs, "logprobs")


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Text
    name: Text | None = None  # accepted, ignored

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, v: Any) -> Any:
        """OpenAI's list-of-parts content: text parts only, joined with newlines (as vLLM does)."""
        if isinstance(v, list):
            try:
                return "\n".join(_TextPart.model_validate(p).text for p in v)
            except ValidationError:
                raise ValueError('only text content parts ({"type": "text", "text": ...}) are supported') from None
        return v


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias; max_completion_tokens wins")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return v

    @property
    def max_output_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else 16

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as `tokenizer.apply_chat_template` takes them."""
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def decode_params(self, defaults: dict) -> DecodeParams:
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self._decode_params(defaults, self.max_output_tokens, k, "top_logprobs")


# ---------------------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class DiffusionUsage(BaseModel):
    """Diffusion metrics of one request (SPEC.md section 8): `denoising_steps` excludes commits,
    `canvases` counts commits, `canvas_positions` the positions those denoising steps evaluated
    (every one is a forward over the whole canvas); derived ratios are None when their denominator is
    0 (AR mode)."""

    denoising_steps: int
    canvases: int
    canvas_positions: int
    steps_per_canvas: float | None = None   # denoising_steps / canvases
    tokens_per_step: float | None = None    # completion tokens / denoising_steps

    @classmethod
    def of(cls, denoising_steps: int, canvases: int, completion_tokens: int, canvas_length: int) -> "DiffusionUsage":
        return cls(denoising_steps=denoising_steps, canvases=canvases,
                   canvas_positions=denoising_steps * canvas_length,
                   steps_per_canvas=denoising_steps / canvases if canvases else None,
                   tokens_per_step=completion_tokens / denoising_steps if denoising_steps else None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    diffusion: DiffusionUsage | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, denoising_steps: int | None = None,
           canvases: int | None = None, canvas_length: int | None = None) -> "Usage":
        diffusion = None
        if denoising_steps is not None:
            assert canvas_length is not None, "diffusion usage needs the canvas length"
            diffusion = DiffusionUsage.of(denoising_steps, canvases or 0, completion_tokens, canvas_length)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, diffusion=diffusion)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk: a choice with a text delta, or (the last, with include_usage) no choices and usage."""


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):  # OpenAI sends {"role": ...} first, then {"content": ...}, last {}
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dllm-serve"
    max_model_len: int | None = None
    canvas_length: int | None = None   # positions denoised together (a draft's width)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
