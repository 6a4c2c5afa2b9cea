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
    ({"max_tokens": 0}, "max_tokens"), ({"n": 2}, "n"), ({"echo": True}, "echo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"temprature": 0.5}, "temprature"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"diffusion": {"threshold": 0}}, "diffusion.threshold"),
    ({"diffusion": {"mode": "x"}}, "diffusion.mode"), ({"diffusion": {"polcy": "leftmost"}}, "diffusion.polcy"),
    ({"diffusion": {"max_denoising_steps": 0}}, "diffusion.max_denoising_steps"),
    ({"prompt": ["one", "two"]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": 3}, "prompt"),
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
    assert "batch prompts are not supported" in _error(CompletionRequest, COMPLETION | {"prompt": ["a", "b"]})[0]
    assert _error(CompletionRequest, COMPLETION | {"temprature": 1})[0] == "temprature: unknown field"
    assert "stream" in _error(CompletionRequest, COMPLETION | {"stream_options": {"include_usage": True}})[0]
    message, param = _error(CompletionRequest, {"prompt": "x", "top_p": 0})  # model missing, top_p bad
    assert param == "model" and "top_p: " in message


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"stream": False, "stream_options": {}}, "stream_options"), ({"n": 3}, "n"), ({"temperature": 3}, "temperature"),
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


def test_requests_parse_and_normalise():
    for prompt, want in [("hi", "hi"), ([5, 6], [5, 6]), (["hi"], "hi"), ([[5, 6]], [5, 6])]:
        assert CompletionRequest.model_validate(COMPLETION | {"prompt": prompt}).prompt == want
    nulls = {k: None for k in ("temperature", "top_p", "stop", "stream_options", "logprobs", "n", "max_tokens",
                               "stream", "echo", "user", "diffusion")}
    req = CompletionRequest.model_validate(COMPLETION | nulls)  # null means "use the default"
    assert (req.max_tokens, req.n, req.stream, req.stop_strings, req.include_usage) == (16, 1, False, [], False)
    req = CompletionRequest.model_validate(COMPLETION | {"stop": "\n", "stream": True, "top_k": -1,
                                                         "stream_options": {"include_usage": True}})
    assert req.stop_strings == ["\n"] and req.include_usage
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatCompletionRequest.model_validate(
        CHAT | {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]})
    assert chat.template_messages() == [{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"}]
    assert chat.max_output_tokens == 16
    assert ChatCompletionRequest.model_validate(CHAT | {"max_tokens": 7}).max_output_tokens == 7
    both = ChatCompletionRequest.model_validate(CHAT | {"max_tokens": 7, "max_completion_tokens": 9})
    assert both.max_output_tokens == 9


def test_completion_decode_params():
    req = CompletionRequest.model_validate(COMPLETION | {
        "max_tokens": 40, "top_p": 0.5, "top_k": -1, "seed": 3, "logprobs": 2, "ignore_eos": True,
        "stop_token_ids": [7, 8], "diffusion": {"policy": "entropy_bound", "entropy_bound": 0.5,
                                                "max_denoising_steps": 4, "eos_early_stop": False}})
    p = req.decode_params(DEFAULTS)
    assert (p.max_tokens, p.top_p, p.top_k, p.seed, p.logprobs, p.ignore_eos, p.stop_token_ids) == (
        40, 0.5, 0, 3, 2, True, (7, 8))
    assert (p.mode, p.policy, p.entropy_bound, p.max_denoising_steps, p.eos_early_stop, p.seed_first_position) == (
        "diffusion", "entropy_bound", 0.5, 4, False, True)
    assert p.temperature is None and p.effective_temperature == 1.0
    plain = CompletionRequest.model_validate(COMPLETION).decode_params(DEFAULTS | {"threshold": 0.7})
    assert (plain.threshold, plain.logprobs, plain.max_tokens, plain.top_k) == (0.7, None, 16, 0)
    spec = CompletionRequest.model_validate(COMPLETION | {"diffusion": {"mode": "linear_spec"}})
    assert spec.decode_params(DEFAULTS).effective_temperature == 0.0


def test_chat_decode_params():
    assert ChatCompletionRequest.model_validate(CHAT).decode_params(DEFAULTS).logprobs is None
    assert ChatCompletionRequest.model_validate(CHAT | {"logprobs": True}).decode_params(DEFAULTS).logprobs == 0
    p = ChatCompletionRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 5, "temperature": 0,
                                                     "max_completion_tokens": 9}).decode_params(DEFAULTS)
    assert (p.logprobs, p.temperature, p.max_tokens) == (5, 0, 9)


def test_decode_params_errors_name_the_fields():
    req = CompletionRequest.model_validate(COMPLETION | {"temperature": 0.5, "diffusion": {"mode": "linear_spec"}})
    with pytest.raises(ValueError) as info:
        req.decode_params(DEFAULTS)
    assert "linear_spec" in str(info.value) and "temperature" in str(info.value)
    chat = ChatCompletionRequest.model_validate(CHAT | {"temperature": 0.5})
    with pytest.raises(ParamError, match="temperature"):
        chat.decode_params(DEFAULTS | {"mode": "linear_spec"})  # the server's default mode conflicts
    with pytest.raises(ParamError) as info:  # a bad server default still names the field
        CompletionRequest.model_validate(COMPLETION).decode_params(DEFAULTS | {"threshold": 0})
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
    """Every DecodeParams value means in the shards' fp32 / int64 tensors what it means here."""
    with pytest.raises(ParamError) as info:
        CompletionRequest.model_validate(COMPLETION | extra).decode_params(DEFAULTS)
    assert info.value.param == param, info.value


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
