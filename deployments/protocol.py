"""The OpenAI-compatible wire format (pydantic v2): requests and responses (errors: deployments/errors.py).

Requests forbid unknown fields, so a misspelt option is a 400 that names it; a JSON `null` means
"not given" (the field's default). Numbers must be finite (Python's json reads NaN and Infinity) and
strings valid Unicode (JSON's \ud800 escapes decode to lone surrogates, which no tokenizer or UTF-8
encoder takes), so neither reaches the engine or an error message. `decode_params(defaults,
default_max_tokens)` turns a request plus the server's and the checkpoint's defaults into the engine's
`DecodeParams`, raising `ParamError` (a ValueError) that names the field; a request that names no
length gets `default_max_tokens(mode)` (the ingress: what the prompt leaves of the context).
OpenAI fields that this server does not implement are taken at the values that change nothing, which
clients send by default (`NO_OPS`); any other value is a 400 naming the field and saying why.
Responses are plain models shaped like OpenAI's (checked against the `openai` client's types).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic import model_serializer
from pydantic import Discriminator, Tag, ValidationInfo, model_validator

from deployments.errors import validation_error_param
from model.grammar.compile import GrammarRequest
from model.sampling.params import MAX_LOGPROBS, DecodeParams, ParamError, settable_fields

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


# Per-request overrides of the server's diffusion defaults (docs/spec.md sections 3-5): the Settable
# fields of DecodeParams, each optional, with DecodeParams' own bounds and descriptions.
DiffusionOptions = create_model("DiffusionOptions", __base__=_Strict, **settable_fields())


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_STOP = 4   # OpenAI's
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (vLLM's too)

_PENALTY = ("a penalty depends on the tokens generated before a position, and a canvas reveals its positions "
            "in parallel, so no penalty is defined")
_FUNCTIONS = "the legacy functions API is not implemented: use tools and tool_choice"
# field -> (is the value a no-op, the no-op value(s) as a message shows them, why another is refused)
NO_OPS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "presence_penalty": (lambda v: v == 0, "0", _PENALTY),
    "frequency_penalty": (lambda v: v == 0, "0", _PENALTY),
    "repetition_penalty": (lambda v: v == 1, "1", _PENALTY),
    "min_p": (lambda v: v == 0, "0", "min_p filtering is not implemented (top_k and top_p are)"),
    "logit_bias": (lambda v: not isinstance(v, dict) or all(b == 0 for b in v.values()), "{} (or biases of 0)",
                   "logit_bias is not implemented"),
    "best_of": (lambda v: v == 1, "1", "best_of > 1 (choosing among several completions) is not implemented"),
    "suffix": (lambda v: v == "", '""', "suffix (inserting text between the prompt and a suffix) is not implemented"),
    "functions": (lambda v: v == [], "[]", _FUNCTIONS),
    "function_call": (lambda v: v in ("none", "auto"), '"none" or "auto" (no functions: plain text)', _FUNCTIONS),
    "store": (lambda v: v is False, "false", "this server does not store completions"),
    "modalities": (lambda v: v == ["text"], '["text"]', "this server's output is text only"),
}


class JsonSchemaFormat(_Strict):
    """OpenAI's `json_schema` of a response_format. Output always follows the schema: `strict` is accepted
    either way (false does not loosen it)."""
    name: Text = Field(max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON following a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema (an object or its text), any JSON object, a
    regular expression, a choice of strings, or a grammar (Lark, or GBNF as llama.cpp writes it)."""
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        return self

    def grammar_request(self) -> GrammarRequest:
        field = "structured_outputs"
        if self.json_ is not None:
            value = self.json_
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as err:
                    raise ParamError(f"structured_outputs.json: not JSON ({err})", "structured_outputs.json") from None
            return GrammarRequest("json_schema", value, f"{field}.json")
        if self.json_object:
            return GrammarRequest("json_object", None, f"{field}.json_object")
        if self.regex is not None:
            return GrammarRequest("regex", self.regex, f"{field}.regex")
        if self.choice is not None:
            return GrammarRequest("choice", self.choice, f"{field}.choice")
        return GrammarRequest("grammar", self.grammar, f"{field}.grammar")


def _no_op(default: Any, *accepted: Any, **schema: Any) -> Any:
    """A NO_OPS field: `default` when not given; the served schema lists the `accepted` values."""
    extra = schema or {"enum": list(accepted or (default,))}
    if isinstance(default, (dict, list)):
        return Field(default_factory=lambda: type(default)(default), json_schema_extra=extra)   # a fresh copy
    return Field(default, json_schema_extra=extra)


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text
    temperature: float | None = Field(None, ge=0, le=2)  # None: DecodeParams' per-mode default
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # choices per prompt; the server's max_n bounds it (deployments/choices.py: each its own request)
    n: int = Field(1, ge=1)
    stop_token_ids: list[int] | None = None
    user: Text | None = None  # accepted, ignored
    diffusion: DiffusionOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None   # vLLM's
    presence_penalty: float = _no_op(0.0)
    frequency_penalty: float = _no_op(0.0)
    repetition_penalty: float = _no_op(1.0)   # vLLM's
    min_p: float = _no_op(0.0)                # vLLM's
    logit_bias: dict[str, float] = _no_op({}, additionalProperties={"type": "number", "enum": [0]})

    @field_validator(*NO_OPS, mode="before", check_fields=False)
    @classmethod
    def _only_no_ops(cls, v: Any, info: ValidationInfo) -> Any:
        is_no_op, shown, why = NO_OPS[info.field_name]
        if not is_no_op(v):
            raise ValueError(f"only {shown} is supported: {why}")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, v: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        fmt = info.data.get("response_format")
        if v is not None and fmt is not None and fmt.type != "text":
            raise ValueError("response_format and structured_outputs both constrain the output: give one")
        return v

    def grammar_request(self) -> GrammarRequest | None:
        """The output's constraint (docs/api.md#structured-output), None for plain text."""
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar_request()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return GrammarRequest("json_object", None, "response_format")
        return GrammarRequest("json_schema", fmt.json_schema.schema_, "response_format.json_schema.schema")

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_four(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings (got {len(v)})")
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _decode_params(self, defaults: dict, max_tokens: int | None, default_max_tokens: Callable[[str], int],
                       logprobs: int | None, logprobs_field: str) -> DecodeParams:
        """`defaults`: the server's and the checkpoint's values of DecodeParams' fields (None: not set);
        `default_max_tokens(mode)`: max_tokens when the request gives none."""
        values = {k: v for k, v in defaults.items() if v is not None}
        if self.diffusion is not None:
            values |= self.diffusion.model_dump(exclude_none=True)
        if values.get("mode") == "linear_spec":   # greedy by definition: no default temperature applies
            values.pop("temperature", None)
        if max_tokens is None:
            max_tokens = default_max_tokens(values.get("mode", "diffusion"))
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


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    # one prompt (a string or a list of token ids) or several (a list of strings or of token-id lists)
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds],
                                                                                    Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description=f"default: {COMPLETION_MAX_TOKENS}, or what the prompt "
                                   "leaves of the context if less")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int = _no_op(1)
    suffix: Text = _no_op("", maxLength=0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_not_empty(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("prompt must not be empty")
        kinds = {int if isinstance(x, int) else type(x) for x in v}
        if len(kinds) > 1:
            raise ValueError("a prompt list holds one kind: token ids, strings, or token-id lists")
        if kinds == {list} and not all(v):
            raise ValueError(f"prompt[{[bool(x) for x in v].index(False)}] must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: one for a string or a token-id list, else the list's entries."""
        if isinstance(self.prompt, str) or all(isinstance(x, int) for x in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v

    def decode_params(self, defaults: dict, default_max_tokens: Callable[[str], int]) -> DecodeParams:
        """`default_max_tokens(mode)`: what the prompt leaves of the context in `mode` (a 16-token default
        must not be a 400 for a request that asked for no length)."""
        return self._decode_params(defaults, self.max_tokens,
                                   lambda mode: min(COMPLETION_MAX_TOKENS, default_max_tokens(mode)),
                                   self.logprobs, "logprobs")


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Strict):
    name: Annotated[Text, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments (None: any object)
    strict: bool | None = None                 # accepted either way: arguments always follow the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict[Literal["name"], Text]


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: Text
    arguments: Text   # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A call an assistant message made (sent back in the next turn of a conversation)."""
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None   # None only for an assistant message that made tool calls
    name: Text | None = None  # accepted, ignored
    tool_calls: list[MessageToolCall] | None = None   # an assistant's
    tool_call_id: Text | None = None                   # a tool's answer: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message makes tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message names the call it answers: tool_call_id")
        return self

    def template(self) -> dict[str, Any]:
        """As chat templates read a message: OpenAI's fields, a call's arguments as an object (what Hugging
        Face's templates take)."""
        m: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m

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
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias; max_completion_tokens wins")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] = Field(default_factory=list, max_length=128)
    # None: "auto" with tools, "none" without (OpenAI's)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] = _no_op([], maxItems=0)
    function_call: str | dict[str, Any] = _no_op("none", "none", "auto")
    store: bool = _no_op(False)
    modalities: list[Literal["text"]] = _no_op(["text"], minItems=1, maxItems=1)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_of_the_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if choice == "required" and not tools:
            raise ValueError('"required" needs tools')
        if isinstance(choice, NamedToolChoice) and choice.function.get("name") not in {t.function.name for t in tools}:
            raise ValueError(f"names {choice.function.get('name')!r}, which is not among the tools")
        fmt = info.data.get("response_format")
        calls = tools and choice != "none"
        if calls and (info.data.get("structured_outputs") is not None or (fmt is not None and fmt.type != "text")):
            raise ValueError("tools constrain the output (unless tool_choice is \"none\"); so do response_format "
                             "and structured_outputs: give one")
        return choice

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or the name of the one function to call."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function["name"]
        return choice or ("auto" if self.tools else "none")

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_mode != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape), None without any."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    @property
    def max_output_tokens(self) -> int | None:
        """The length asked for; None: the default (the rest of the context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as `tokenizer.apply_chat_template` takes them."""
        return [m.template() for m in self.messages]

    def decode_params(self, defaults: dict, default_max_tokens: Callable[[str], int]) -> DecodeParams:
        """`default_max_tokens(mode)`: the rest of the context in `mode`, as vLLM's chat default."""
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self._decode_params(defaults, self.max_output_tokens, default_max_tokens, k, "top_logprobs")


class TokenizeCompletionRequest(_Strict):
    """vLLM's POST /tokenize with a prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True   # e.g. BOS, as /v1/completions tokenizes a prompt
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's POST /tokenize with messages: the chat template applied, as /v1/chat/completions does."""

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False   # the template writes them
    return_token_strs: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template() for m in self.messages]


def _tokenize_kind(v: Any) -> str:
    return "Chat" if isinstance(v, dict) and "messages" in v else "Completion"


# A body with `messages` is a chat one, any other a prompt one (so an error names that kind's fields only).
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("Completion")]
                            | Annotated[TokenizeChatRequest, Tag("Chat")], Discriminator(_tokenize_kind)]


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize."""

    model: Text | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class DiffusionUsage(BaseModel):
    """Diffusion metrics of one request (docs/spec.md section 8): `denoising_steps` excludes commits,
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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0     # the prompt's tokens whose KV the prefix cache served (OpenAI's field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    diffusion: DiffusionUsage | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, denoising_steps: int | None = None,
           canvases: int | None = None, canvas_length: int | None = None, cached_tokens: int = 0) -> "Usage":
        diffusion = None
        if denoising_steps is not None:
            assert canvas_length is not None, "diffusion usage needs the canvas length"
            diffusion = DiffusionUsage.of(denoising_steps, canvases or 0, completion_tokens, canvas_length)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens), diffusion=diffusion)


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
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None   # OpenAI's: id, type "function", function {name, arguments}

    @model_serializer(mode="wrap")
    def _no_empty_calls(self, handler):
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


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
    tool_calls: list[dict[str, Any]] | None = None

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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
