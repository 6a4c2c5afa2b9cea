"""The OpenAI wire format: validation errors name the field, decode_params maps onto DecodeParams, and the
real `openai` client parses our responses (directly, and through its HTTP and SSE code on a mock transport)."""
import json
import math

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError
from transformers import AutoTokenizer

from deployments.errors import error_body, validation_error_param
from deployments.output import chat_logprobs, completion_logprobs
from deployments.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, ChatDelta,
    ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionRequest, CompletionResponse,
    CompletionStreamResponse, ModelCard, ModelList, Usage)
from model.sampling.params import ParamError
from model.tiny import write_nemotron_ld

DEFAULTS = {"mode": "diffusion", "policy": "threshold", "threshold": 0.9, "entropy_bound": 0.1,
            "max_denoising_steps": None}
ROOM = {"diffusion": 480, "ar": 500, "linear_spec": 480}.__getitem__   # the default max_tokens, by mode
COMPLETION = {"model": "tiny", "prompt": "Hello"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_nemotron_ld(tmp_path_factory.mktemp("protocol-tok")))


def _error(cls, body):
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return validation_error_param(info.value)


@pytest.mark.parametrize("extra, param", [
    ({"temperature": -1}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"echo": True}, "echo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"temprature": 0.5}, "temprature"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"diffusion": {"threshold": 0}}, "diffusion.threshold"),
    ({"diffusion": {"mode": "x"}}, "diffusion.mode"), ({"diffusion": {"polcy": "leftmost"}}, "diffusion.polcy"),
    ({"diffusion": {"max_denoising_steps": 0}}, "diffusion.max_denoising_steps"),
    ({"prompt": ["one", 2]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": 3}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": [[1], "a"]}, "prompt"), ({"prompt": ["a", "\ud800"]}, "prompt"),
    # what Python's json reads but the engine must not see: NaN, Infinity, lone surrogates; any unknown key
    ({"temperature": math.nan}, "temperature"), ({"top_p": math.inf}, "top_p"),
    ({"diffusion": {"entropy_bound": math.inf}}, "diffusion.entropy_bound"), ({"prompt": "a\ud800"}, "prompt"),
    ({"model": "\udfff"}, "model"), ({"user": "\ud800"}, "user"), ({"Max-Tokens": 1}, "Max-Tokens"),
    ({"diffusion": {"Mode": "ar"}}, "diffusion.Mode"),
])
def test_completion_errors_name_the_field(extra, param):
    message, got = _error(CompletionRequest, COMPLETION | extra)
    assert got == param and message.startswith(f"{param}: "), message


def test_completion_error_messages():
    assert "one kind" in _error(CompletionRequest, COMPLETION | {"prompt": ["a", [1]]})[0]
    assert "prompt[1] must not be empty" in _error(CompletionRequest, COMPLETION | {"prompt": [[1], []]})[0]
    assert _error(CompletionRequest, COMPLETION | {"temprature": 1})[0] == "temprature: unknown field"
    assert "stream" in _error(CompletionRequest, COMPLETION | {"stream_options": {"include_usage": True}})[0]
    message, param = _error(CompletionRequest, {"prompt": "x", "top_p": 0})  # model missing, top_p bad
    assert param == "model" and "top_p: " in message


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"stream": False, "stream_options": {}}, "stream_options"), ({"n": -1}, "n"), ({"temperature": 3}, "temperature"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"echo": False}, "echo"),
    ({"diffusion": {"entropy_bound": 0}}, "diffusion.entropy_bound"),
])
def test_chat_errors_name_the_field(extra, param):
    message, got = _error(ChatCompletionRequest, CHAT | extra)
    assert got == param and message.startswith(f"{param}: "), message


def test_fastapi_error_lists():
    errors = [{"loc": ("body", "diffusion", "threshold"), "msg": "Input should be greater than 0",
               "type": "greater_than"}]
    assert validation_error_param(errors) == ("diffusion.threshold: Input should be greater than 0",
                                              "diffusion.threshold")
    assert validation_error_param([{"loc": ("body", 7), "msg": "JSON decode error", "type": "json_invalid",
                                    "ctx": {"error": "Expecting value"}}]) == (
        "the body is not valid JSON: Expecting value at character 7", None)
    assert validation_error_param([{"loc": ("body", "diffusion", "Policy"), "msg": "Extra inputs are not permitted",
                                    "type": "extra_forbidden"}]) == ("diffusion.Policy: unknown field",
                                                                     "diffusion.Policy")
    # a key that is the empty string is still named (schemathesis sent {"tokens": [], "": []})
    assert validation_error_param([{"loc": ("body", "messages", 1, ""), "msg": "Extra inputs are not permitted",
                                    "type": "extra_forbidden"}]) == ('messages[1]."": unknown field', 'messages[1].""')


def test_requests_parse_and_normalise():
    for prompt, want in [("hi", ["hi"]), ([5, 6], [[5, 6]]), (["hi"], ["hi"]), ([[5, 6]], [[5, 6]]),
                         (["a", "b"], ["a", "b"]), ([[5], [6, 7]], [[5], [6, 7]])]:
        assert CompletionRequest.model_validate(COMPLETION | {"prompt": prompt}).prompts == want
    nulls = {k: None for k in ("temperature", "top_p", "stop", "stream_options", "logprobs", "n", "max_tokens",
                               "stream", "echo", "user", "diffusion")}
    req = CompletionRequest.model_validate(COMPLETION | nulls)  # null means "use the default"
    assert (req.max_tokens, req.n, req.stream, req.stop_strings, req.include_usage) == (None, 1, False, [], False)
    req = CompletionRequest.model_validate(COMPLETION | {"stop": "\n", "stream": True, "top_k": -1,
                                                         "stream_options": {"include_usage": True}})
    assert req.stop_strings == ["\n"] and req.include_usage
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatCompletionRequest.model_validate(
        CHAT | {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]})
    assert chat.template_messages() == [{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"}]
    assert chat.max_output_tokens is None   # the default: decode_params' default_max_tokens
    assert ChatCompletionRequest.model_validate(CHAT | {"max_tokens": 7}).max_output_tokens == 7
    both = ChatCompletionRequest.model_validate(CHAT | {"max_tokens": 7, "max_completion_tokens": 9})
    assert both.max_output_tokens == 9


def test_completion_decode_params():
    req = CompletionRequest.model_validate(COMPLETION | {
        "max_tokens": 40, "top_p": 0.5, "top_k": -1, "seed": 3, "logprobs": 2, "ignore_eos": True,
        "stop_token_ids": [7, 8], "diffusion": {"policy": "entropy_bound", "entropy_bound": 0.5,
                                                "max_denoising_steps": 4, "eos_early_stop": False}})
    p = req.decode_params(DEFAULTS, ROOM)
    assert (p.max_tokens, p.top_p, p.top_k, p.seed, p.logprobs, p.ignore_eos, p.stop_token_ids) == (
        40, 0.5, 0, 3, 2, True, (7, 8))
    assert (p.mode, p.policy, p.entropy_bound, p.max_denoising_steps, p.eos_early_stop, p.seed_first_position) == (
        "diffusion", "entropy_bound", 0.5, 4, False, True)
    assert p.temperature is None and p.effective_temperature == 1.0
    plain = CompletionRequest.model_validate(COMPLETION).decode_params(DEFAULTS | {"threshold": 0.7}, ROOM)
    assert (plain.threshold, plain.logprobs, plain.max_tokens, plain.top_k) == (0.7, None, 16, 0)
    spec = CompletionRequest.model_validate(COMPLETION | {"diffusion": {"mode": "linear_spec"}})
    assert spec.decode_params(DEFAULTS, ROOM).effective_temperature == 0.0


def test_chat_decode_params():
    assert ChatCompletionRequest.model_validate(CHAT).decode_params(DEFAULTS, ROOM).logprobs is None
    assert ChatCompletionRequest.model_validate(CHAT | {"logprobs": True}).decode_params(DEFAULTS, ROOM).logprobs == 0
    p = ChatCompletionRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 5, "temperature": 0,
                                                     "max_completion_tokens": 9}).decode_params(DEFAULTS, ROOM)
    assert (p.logprobs, p.temperature, p.max_tokens) == (5, 0, 9)


def test_decode_params_errors_name_the_fields():
    req = CompletionRequest.model_validate(COMPLETION | {"temperature": 0.5, "diffusion": {"mode": "linear_spec"}})
    with pytest.raises(ValueError) as info:
        req.decode_params(DEFAULTS, ROOM)
    assert "linear_spec" in str(info.value) and "temperature" in str(info.value)
    chat = ChatCompletionRequest.model_validate(CHAT | {"temperature": 0.5})
    with pytest.raises(ParamError, match="temperature"):
        chat.decode_params(DEFAULTS | {"mode": "linear_spec"}, ROOM)  # the server's default mode conflicts
    with pytest.raises(ParamError) as info:  # a bad server default still names the field
        CompletionRequest.model_validate(COMPLETION).decode_params(DEFAULTS | {"threshold": 0}, ROOM)
    assert info.value.param == "diffusion.threshold" and str(info.value).startswith("diffusion.threshold: ")


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 0.5, "diffusion": {"mode": "linear_spec"}}, "temperature"),      # conflicts: the later field
    ({"diffusion": {"t_min": 0.5, "t_max": 0.5}}, "diffusion.t_max"),
    ({"diffusion": {"t_min": 0.5, "t_max": 0.5000000001}}, "diffusion.t_max"),       # equal in fp32
    ({"diffusion": {"t_min": 0.0, "t_max": 5e-324}}, "diffusion.t_max"),              # 0 in fp32
    ({"top_p": 1e-46}, "top_p"), ({"diffusion": {"threshold": 1e-300}}, "diffusion.threshold"),
    ({"top_k": 2**40}, "top_k"), ({"diffusion": {"stability_threshold": 10**30}}, "diffusion.stability_threshold"),
    ({"diffusion": {"entropy_bound": 1e308}}, "diffusion.entropy_bound"),
    ({"diffusion": {"t_max": 1e3}}, "diffusion.t_max"),
])
def test_values_the_engine_cannot_hold_are_errors_naming_the_field(extra, param):
    """Every DecodeParams value means in the shards' fp32 / int64 tensors what it means here: refused by
    the wire model (its bounds are DecodeParams') or by decode_params' cross-field checks, either a 400
    naming the field."""
    try:
        CompletionRequest.model_validate(COMPLETION | extra).decode_params(DEFAULTS, ROOM)
    except ValidationError as err:
        assert validation_error_param(err)[1] == param, err
    except ParamError as err:
        assert err.param == param, err
    else:
        pytest.fail(f"{extra} was taken")


def test_the_diffusion_object_and_the_server_defaults_are_declared_by_decode_params():
    """One declaration: the wire's `diffusion` fields and AppArgs' decoding defaults have DecodeParams'
    types, bounds and descriptions (the wire's optional), so none can drift from the engine's."""
    from deployments.args import AppArgs
    from deployments.protocol import DiffusionOptions
    from model.sampling.params import DecodeParams

    engine = DecodeParams.model_json_schema()["properties"]
    wire = DiffusionOptions.model_json_schema()["properties"]
    server = AppArgs.model_json_schema()["properties"]
    assert {"mode", "policy", "threshold", "entropy_bound", "seed_first_position", "draft_every"} <= set(wire)
    assert {"mode", "threshold", "entropy_bound", "t_min", "max_denoising_steps"} <= set(server)
    assert "draft_every" not in server and "temperature" not in wire   # per request only; top-level OpenAI field

    def bounds(prop):
        kinds = prop.get("anyOf", [prop])
        return [{k: v for k, v in kind.items() if k not in ("title", "default", "description")} for kind in kinds
                if kind.get("type") != "null"], prop.get("description")

    for name in wire:
        assert bounds(wire[name]) == bounds(engine[name]), name
    for name in set(server) & set(engine):
        assert bounds(server[name]) == bounds(engine[name]) and server[name].get("default") == \
            engine[name].get("default"), name
    with pytest.raises(ValidationError, match="t_max"):   # DecodeParams' cross-field check, at deploy
        AppArgs(t_min=0.5, t_max=0.5)


def test_a_silent_max_tokens_takes_the_default_of_its_kind_and_mode():
    """Chat: the rest of the context in the request's mode (vLLM's default); completions: OpenAI's 16,
    or less when the prompt leaves less; a given length is kept as given."""
    chat = ChatCompletionRequest.model_validate(CHAT)
    assert chat.decode_params(DEFAULTS, ROOM).max_tokens == 480
    assert ChatCompletionRequest.model_validate(CHAT | {"diffusion": {"mode": "ar"}}).decode_params(
        DEFAULTS, ROOM).max_tokens == 500
    assert chat.decode_params(DEFAULTS | {"mode": "ar"}, ROOM).max_tokens == 500   # the server's default mode
    assert ChatCompletionRequest.model_validate(CHAT | {"max_tokens": 7}).decode_params(DEFAULTS, ROOM).max_tokens == 7
    completion = CompletionRequest.model_validate(COMPLETION)
    assert completion.decode_params(DEFAULTS, ROOM).max_tokens == 16
    assert completion.decode_params(DEFAULTS, lambda mode: 5).max_tokens == 5
    assert CompletionRequest.model_validate(COMPLETION | {"max_tokens": 40}).decode_params(
        DEFAULTS, lambda mode: 5).max_tokens == 40   # the scheduler answers a length that does not fit

    def no_room(mode):
        raise ParamError("no room", "prompt")
    with pytest.raises(ParamError):
        completion.decode_params(DEFAULTS, no_room)


def test_checkpoint_sampling_defaults_apply_when_the_request_is_silent():
    """generation_config.json's temperature/top_k/top_p (in `defaults`) fill what a request leaves out;
    a request's own value wins; linear_spec stays greedy whatever the checkpoint's temperature."""
    defaults = DEFAULTS | {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    p = CompletionRequest.model_validate(COMPLETION).decode_params(defaults, ROOM)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 20, 0.95)
    p = CompletionRequest.model_validate(COMPLETION | {"temperature": 0, "top_k": -1, "top_p": 1}).decode_params(
        defaults, ROOM)
    assert (p.temperature, p.top_k, p.top_p) == (0, 0, 1)
    spec = ChatCompletionRequest.model_validate(CHAT | {"diffusion": {"mode": "linear_spec"}})
    assert spec.decode_params(defaults, ROOM).effective_temperature == 0.0


def test_sampling_defaults_by_family(tiny_nemotron, tmp_path):
    """Nemotron-LD takes temperature, top_k and top_p from generation_config.json; DiffusionGemma top_k and
    top_p (its temperature is its renoise schedule's); an unusable value fails the deploy."""
    from deployments.ingress import sampling_defaults
    from model.checkpoint import Checkpoint
    from model.config import DiffusionGemmaConfig, GenerationDefaults, RenoiseDefaults
    from model.tiny import DIFFUSION_GEMMA_TINY_TEXT_CONFIG

    nemotron = Checkpoint.read(tiny_nemotron)
    assert sampling_defaults(nemotron) == {}   # the tiny checkpoint's generation_config names none
    gen = GenerationDefaults(temperature=0.7, top_k=64, top_p=0.95, max_new_tokens=100)
    assert sampling_defaults(nemotron.model_copy(update={"generation": gen})) == {
        "temperature": 0.7, "top_k": 64, "top_p": 0.95}
    gemma_config = DiffusionGemmaConfig.model_validate({"model_type": "diffusion_gemma",
                                                        "text_config": DIFFUSION_GEMMA_TINY_TEXT_CONFIG})
    gemma = Checkpoint(path=str(tmp_path), config=gemma_config, generation=gen, renoise=RenoiseDefaults())
    assert sampling_defaults(gemma) == {"top_k": 64, "top_p": 0.95}
    hot = nemotron.model_copy(update={"generation": GenerationDefaults(temperature=1e6)})
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        sampling_defaults(hot)


@pytest.mark.parametrize("path, extra", [
    ("completions", {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0,
                     "logit_bias": {}, "best_of": 1, "suffix": "", "user": "u", "echo": False, "n": 1}),
    ("completions", {"logit_bias": {"50": 0}}),
    ("chat", {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
              "parallel_tool_calls": False, "tools": [], "tool_choice": "none", "functions": [],
              "function_call": "auto", "store": False, "modalities": ["text"], "user": "u", "n": 1}),
    ("chat", {"parallel_tool_calls": True, "tool_choice": "auto"}),
])
def test_openai_fields_at_their_no_op_values_are_accepted(path, extra):
    cls, base = (CompletionRequest, COMPLETION) if path == "completions" else (ChatCompletionRequest, CHAT)
    plain = cls.model_validate(base).decode_params(DEFAULTS, ROOM)
    assert cls.model_validate(base | extra).decode_params(DEFAULTS, ROOM) == plain


@pytest.mark.parametrize("cls, extra, param, why", [
    (CompletionRequest, {"presence_penalty": 0.5}, "presence_penalty", "in parallel"),
    (ChatCompletionRequest, {"frequency_penalty": -1}, "frequency_penalty", "in parallel"),
    (CompletionRequest, {"repetition_penalty": 1.1}, "repetition_penalty", "in parallel"),
    (CompletionRequest, {"min_p": 0.1}, "min_p", "not implemented"),
    (ChatCompletionRequest, {"logit_bias": {"5": 10}}, "logit_bias", "not implemented"),
    (CompletionRequest, {"best_of": 3}, "best_of", "not implemented"),
    (CompletionRequest, {"suffix": "end"}, "suffix", "not implemented"),
    (ChatCompletionRequest, {"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given"),
    (ChatCompletionRequest, {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
     "response_format", "json_schema is given"),
    (CompletionRequest, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    (CompletionRequest, {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "give one"),
    (ChatCompletionRequest, {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name",
     "pattern"),
    (ChatCompletionRequest, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (ChatCompletionRequest, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "not among the tools"),
    (ChatCompletionRequest, {"functions": [{"name": "f"}]}, "functions", "use tools and tool_choice"),
    (ChatCompletionRequest, {"store": True}, "store", "does not store"),
    (ChatCompletionRequest, {"modalities": ["text", "audio"]}, "modalities", "text only"),
    (CompletionRequest, {"stop": list("abcde")}, "stop", "at most 4 stop strings (got 5)"),
    (ChatCompletionRequest, {"stop": ["x"] * 9}, "stop", "at most 4 stop strings (got 9)"),
])
def test_values_that_would_change_the_output_name_the_field_and_say_why(cls, extra, param, why):
    message, got = _error(cls, (COMPLETION if cls is CompletionRequest else CHAT) | extra)
    assert got == param and message.startswith(f"{param}: ") and why in message, message
    assert "valid string" not in message


def test_no_op_fields_are_in_the_served_schema_at_their_no_op_values():
    """The schema lists what is accepted, so a client (and the schemathesis fuzz's valid requests) sends
    the no-op values, and the fuzz's invalid ones the rest."""
    chat = ChatCompletionRequest.model_json_schema()["properties"]
    completion = CompletionRequest.model_json_schema()["properties"]
    assert chat["presence_penalty"]["enum"] == [0] and completion["best_of"]["enum"] == [1]
    assert chat["functions"]["maxItems"] == 0 and chat["function_call"]["enum"] == ["none", "auto"]
    assert chat["store"]["enum"] == [False] and completion["suffix"]["maxLength"] == 0


class _CountingTokenizer:
    """The tokenizer, counting the characters it was given to tokenize."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __len__(self):
        return len(self.tok)

    def get_vocab(self):
        return self.tok.get_vocab()

    def __call__(self, text, **kw):
        self.chars += len(text)
        return self.tok(text, **kw)

    def apply_chat_template(self, messages, **kw):
        self.chars += sum(len(m["content"]) for m in messages)
        return self.tok.apply_chat_template(messages, **kw)


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(tok):
    import asyncio

    from deployments.errors import APIError
    from deployments.prompts import PromptTokenizer

    counting = _CountingTokenizer(tok)
    prompts = PromptTokenizer(counting, max_model_len=64)
    longest = max(map(len, tok.get_vocab()))
    assert prompts.max_chars == 64 * 2 * longest
    assert asyncio.run(prompts.text("hello " * 10, "prompt")) == tok("hello " * 10).input_ids
    for call, param in [(prompts.text("x" * (prompts.max_chars + 1), "prompt"), "prompt"),
                        (prompts.chat([{"role": "user", "content": "x" * prompts.max_chars}], "messages"), "messages")]:
        before = counting.chars
        with pytest.raises(APIError) as err:
            asyncio.run(call)
        assert (err.value.status, err.value.param) == (400, param) and "characters" in err.value.message
        assert counting.chars == before   # refused before any tokenizing
    with pytest.raises(APIError) as err:
        prompts.ids([1, len(tok)], "prompt")
    assert err.value.param == "prompt" and str(len(tok)) in err.value.message


def test_tokenizing_runs_off_the_event_loop(tok):
    """While a long prompt is tokenized, the loop keeps running (other requests are answered): its longest
    pause is a fraction of the tokenizing time, which it would be whole if the tokenizer ran on it."""
    import asyncio
    import time

    from deployments.prompts import PromptTokenizer

    prompts = PromptTokenizer(tok, max_model_len=10**6)
    text = "hello world " * 150_000

    async def run():
        gaps, done = [], asyncio.Event()

        async def tick():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                gaps.append(time.perf_counter() - t)
        ticker = asyncio.create_task(tick())
        start = time.perf_counter()
        ids = await prompts.text(text, "prompt")
        took = time.perf_counter() - start
        done.set()
        await ticker
        return ids, took, max(gaps, default=took)   # no tick at all: the loop was held throughout

    ids, took, longest_gap = asyncio.run(run())
    assert len(ids) > 300_000 and took > 0.2, took   # long enough to tell the two apart
    assert longest_gap < took / 3, (longest_gap, took)


def _completion_response(tok, ids, lps, top):
    text = tok.decode(ids)
    lp = completion_logprobs(tok, ids, lps, top, 5)
    usage = Usage.of(5, len(ids), denoising_steps=6, canvases=2, canvas_length=32)
    return CompletionResponse(model="tiny", usage=usage,
                              choices=[CompletionChoice(text=text, logprobs=lp, finish_reason="length")])


def test_openai_types_parse_completion(tok):
    ids = tok.encode("The answer is 42.", add_special_tokens=False)
    lps = [-0.5] * (len(ids) - 1) + [-math.inf]
    top = [[(i, -0.1), (tok.eos_token_id, -math.inf)] for i in ids]
    body = json.loads(_completion_response(tok, ids, lps, top).model_dump_json())
    c = Completion.model_validate(body)
    assert c.object == "text_completion" and c.choices[0].text == "The answer is 42."
    assert c.choices[0].logprobs.tokens == [tok.decode([i]) for i in ids]
    assert c.choices[0].logprobs.token_logprobs[-1] == -9999.0
    assert c.choices[0].logprobs.top_logprobs[0] == {"The": -0.1, "</s>": -9999.0}
    assert c.choices[0].logprobs.text_offset[:2] == [5, 5 + len(tok.decode(ids[:1]))]
    assert c.usage.total_tokens == 5 + len(ids)
    assert c.usage.model_extra["diffusion"] == {"denoising_steps": 6, "canvases": 2, "canvas_positions": 6 * 32,
                                                "steps_per_canvas": 3.0, "tokens_per_step": len(ids) / 6}
    chunk = CompletionStreamResponse(model="tiny", choices=[CompletionChoice(text="x", finish_reason="stop")])
    assert Completion.model_validate(json.loads(chunk.model_dump_json())).choices[0].text == "x"
    last = CompletionStreamResponse(model="tiny", choices=[], usage=Usage.of(3, 4))
    assert Completion.model_validate(json.loads(last.model_dump_json())).usage.completion_tokens == 4


def test_openai_types_parse_chat(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    lp = chat_logprobs(tok, ids, [-1.0] * len(ids), [[(i, -1.0), (7, -math.inf)] for i in ids])
    resp = ChatCompletionResponse(model="tiny", usage=Usage.of(3, len(ids)), choices=[
        ChatChoice(message=ChatResponseMessage(content="Hello world"), logprobs=lp, finish_reason="stop")])
    c = ChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert c.object == "chat.completion" and c.choices[0].message.content == "Hello world"
    content = c.choices[0].logprobs.content
    assert [t.token for t in content] == [tok.decode([i]) for i in ids]
    assert "".join(t.token for t in content) == "Hello world"
    assert content[-1].bytes == list(tok.decode(ids[-1:]).encode())
    assert content[0].top_logprobs[1].logprob == -9999.0 and content[0].top_logprobs[0].token == tok.decode(ids[:1])
    first = ChatCompletionStreamResponse(model="tiny", choices=[ChatStreamChoice(delta=ChatDelta(role="assistant",
                                                                                                 content=""))])
    body = json.loads(first.model_dump_json())
    assert body["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    end = ChatCompletionStreamResponse(model="tiny",
                                       choices=[ChatStreamChoice(delta=ChatDelta(), finish_reason="stop")])
    assert json.loads(end.model_dump_json())["choices"][0]["delta"] == {}
    for chunk in (first, end, ChatCompletionStreamResponse(model="tiny", choices=[], usage=Usage.of(1, 2))):
        parsed = ChatCompletionChunk.model_validate(json.loads(chunk.model_dump_json()))
        assert parsed.object == "chat.completion.chunk"
    models = ModelList(data=[ModelCard(id="tiny", max_model_len=2048)]).model_dump()
    assert Model.model_validate(models["data"][0]).id == "tiny" and models["object"] == "list"
    assert error_body("bad", param="top_p") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                          "param": "top_p", "code": None}}


def _sse(chunks) -> bytes:
    return b"".join(f"data: {c.model_dump_json()}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_openai_client_through_a_mock_transport(tok):
    """The real client's request serialisation, SSE parsing and error mapping against our models, its
    requests answered in process by an httpx.MockTransport (no server, no socket; tests/test_http.py
    serves over HTTP)."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/chat/completions"):
            ChatCompletionRequest.model_validate(body)
            chunks = [ChatCompletionStreamResponse(id="c1", model="tiny", choices=[
                ChatStreamChoice(delta=ChatDelta(role="assistant", content=""))])]
            chunks += [ChatCompletionStreamResponse(id="c1", model="tiny", choices=[
                ChatStreamChoice(delta=ChatDelta(content=t))]) for t in ("Hel", "lo")]
            chunks += [ChatCompletionStreamResponse(id="c1", model="tiny", choices=[
                ChatStreamChoice(delta=ChatDelta(), finish_reason="stop")]),
                ChatCompletionStreamResponse(id="c1", model="tiny", choices=[], usage=Usage.of(2, 2))]
            return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as err:
            message, param = validation_error_param(err)
            return httpx.Response(400, json=error_body(message, param=param))
        ids = tok.encode(req.prompt, add_special_tokens=False)
        return httpx.Response(200, json=_completion_response(tok, ids, [-0.25] * len(ids), None).model_dump())

    client = openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    c = client.completions.create(model="tiny", prompt="Hello world", logprobs=0, max_tokens=4,
                                  extra_body={"diffusion": {"policy": "leftmost"}})
    pieces = [tok.decode([i]) for i in tok.encode("Hello world", add_special_tokens=False)]
    assert c.choices[0].text == "Hello world" and c.choices[0].logprobs.token_logprobs == [-0.25] * len(pieces)
    assert c.choices[0].logprobs.top_logprobs == [{p: -0.25} for p in pieces]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", top_p=0)
    assert info.value.body["param"] == "top_p"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.total_tokens == 4
