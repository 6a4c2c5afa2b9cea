"""Bad input to the app, for both families: a table of known-bad requests (out-of-range and
non-finite numbers, oversized prompts and bodies, token ids out of range, huge integers, deep JSON,
non-UTF-8 and non-JSON bodies, lone surrogates, wrong content types, OpenAI fields at values not
implemented, malformed X-Request-Id headers, n and prompt lists beyond the servers' bounds, bad
/tokenize and /detokenize bodies) and schemathesis-generated requests from the served OpenAPI schema of
/v1/completions, /v1/chat/completions, /v1/models/{model_id}, /tokenize and /detokenize
(schema-violating and valid ones).
No response is a 5xx; every 4xx has OpenAI's error shape, and `param` names the field whenever the
body is a JSON object; no input fails a shard; the server answers normally afterwards.

What is under test is the app (its gate, validation and answers), so it runs in this process
(tests/inprocess.py: the real ingress and coordinator over an in-process shard); the same app's errors
over Serve's proxy and real HTTP are tests/test_http.py's."""
import collections
import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")   # absent on the GPU host (no registry there)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from deployments.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                  TokenizeCompletionRequest)
from model.tiny import write_diffusion_gemma
from tests.inprocess import inprocess_app
from tests.serve_harness import assert_openai_error

MODEL = "tiny"
MAX_MODEL_LEN = 64
STEPS_LIMIT = 64   # the servers' denoising_steps_limit: a random valid request stays seconds long on a CPU
BODY_LIMIT = 2 * 2**20   # the servers' max_body_bytes (the 1 MB prompt below fits, and is refused for its length)
# per app, path and generation mode (8 combinations): a fixed sequence in `make test` (a regression
# suite that cannot pass or fail by luck), fresh random ones under -m reliability
FUZZ_EXAMPLES = {"fixed": 100, "random": 1000}
MAX_N, MAX_CHOICES = 3, 6   # the servers' max_n and max_choices: a valid random request stays seconds long
REQUEST_FIELDS = {"/v1/completions": set(CompletionRequest.model_fields),
                  "/v1/chat/completions": set(ChatCompletionRequest.model_fields),
                  "/tokenize": set(TokenizeCompletionRequest.model_fields) | set(TokenizeChatRequest.model_fields),
                  "/detokenize": set(DetokenizeRequest.model_fields)}
tally = collections.Counter()  # the figures the module reports at its end


@pytest.fixture(scope="module")
def server(tiny_nemotron, tmp_path_factory):
    """app name -> a client of the in-process app serving that family."""
    common = dict(served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_queue=64,
                  denoising_steps_limit=STEPS_LIMIT, max_body_bytes=BODY_LIMIT, max_n=MAX_N, max_choices=MAX_CHOICES)
    gemma = write_diffusion_gemma(tmp_path_factory.mktemp("tiny-gemma-fuzz"), seed=0)
    with inprocess_app(tiny_nemotron, **common) as nemotron, inprocess_app(gemma, **common) as gemma_client:
        yield {"nemotron": nemotron, "gemma": gemma_client}
    print(f"\nbad input: {dict(tally)}")


def post(clients: dict, app: str, path: str, body=None, raw: bytes | None = None,
         content_type: str = "application/json", headers: dict | None = None):
    headers = {**({"content-type": content_type} if raw is not None else {}), **(headers or {})}
    return clients[app].post(path, json=body if raw is None else None, content=raw, headers=headers or None)


def health(clients: dict, app: str):
    return clients[app].get("/health")


def send(client, kwargs: dict):
    """A request as schemathesis serialises it (requests' keyword arguments), sent through `client`."""
    headers = {k: v.encode() if isinstance(v, str) else v for k, v in (kwargs.get("headers") or {}).items()}
    body = {"json": kwargs["json"]} if "json" in kwargs else {"content": kwargs["data"]} if "data" in kwargs else {}
    assert not kwargs.get("cookies"), kwargs   # the served schema declares none
    return client.request(kwargs["method"], kwargs["url"], headers=headers, params=kwargs.get("params"), **body)


def check_response(r: httpx.Response, path: str, body, headers: dict | None = None) -> None:
    """No 5xx; a 4xx is OpenAI-shaped and, for a JSON-object body, names a field of the request (or the
    unknown one it sent, or a header it sent); a 200 is a whole answer."""
    tally[r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code} for {body!r:.300}: {r.text[:300]}"
    if r.status_code >= 400:
        error = assert_openai_error(r.json(), r.status_code)
        if isinstance(body, dict):
            assert error["param"], f"no param for {body!r:.300}: {error}"
            head = error["param"].split(".")[0].split("[")[0]
            key = "" if head == '""' else head   # an empty-string key is named '""'
            sent = {h.lower() for h in headers or {}}
            # (a key the client sent may itself hold a dot: then the whole param is that key)
            assert head in REQUEST_FIELDS[path] or key in body or error["param"] in body or head.lower() in sent, error
        return
    assert r.status_code == 200
    if path == TOKENIZE:
        assert r.json()["count"] == len(r.json()["tokens"]), r.text[:300]
    elif path == DETOKENIZE:
        assert isinstance(r.json()["prompt"], str), r.text[:300]
    elif isinstance(body, dict) and body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    else:
        assert r.json()["choices"], r.text[:300]


# ---- known-bad requests --------------------------------------------------------------------------

C, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def raw_json(text: str) -> bytes:
    return text.encode()


# (id, path, body: a dict sent as JSON or bytes sent raw, content type, expected status, expected param)
BAD = [
    # out of range, each named (the ingress's original table)
    ("temperature<0", C, OK | {"temperature": -1}, None, 400, "temperature"),
    ("top_p=0", C, OK | {"top_p": 0}, None, 400, "top_p"),
    ("top_k<-1", C, OK | {"top_k": -5}, None, 400, "top_k"),
    ("logprobs>20", C, OK | {"logprobs": 21}, None, 400, "logprobs"),
    ("max_tokens=0", C, OK | {"max_tokens": 0}, None, 400, "max_tokens"),
    # choices: n up to max_n, prompts x n up to max_choices, prompt lists of one kind
    ("n=0", C, OK | {"n": 0}, None, 400, "n"),
    ("n > max_n", C, OK | {"n": MAX_N + 1}, None, 400, "n"),
    ("n > max_n, chat", CHAT, OK_CHAT | {"n": MAX_N + 1}, None, 400, "n"),
    ("n 10^30", C, OK | {"n": 10**30}, None, 400, "n"),
    ("prompts x n > max_choices", C, OK | {"prompt": ["a", "b", "c"], "n": MAX_N}, None, 400, "n"),
    ("prompts > max_choices", C, OK | {"prompt": [[1, 300]] * (MAX_CHOICES + 1)}, None, 400, "prompt"),
    ("prompt list of mixed kinds", C, OK | {"prompt": ["a", [1, 2]]}, None, 400, "prompt"),
    ("prompt list with an empty token list", C, OK | {"prompt": [[1], []]}, None, 400, "prompt"),
    ("prompt list, one too long", C, OK | {"prompt": ["hi", "hello " * 200]}, None, 400, "prompt[1]"),
    ("prompt list, a token id = vocab", C, OK | {"prompt": [[1, 5], [1, 997]]}, None, 400, "prompt[1]"),
    ("prompt list, a lone surrogate", C, raw_json('{"model": "tiny", "prompt": ["a", "\\ud800"]}'), None, 400,
     "prompt"),
    # /tokenize and /detokenize (vLLM's)
    ("tokenize: prompt not a string", TOKENIZE, {"prompt": 5}, None, 400, "prompt"),
    ("tokenize: prompt and messages", TOKENIZE, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None,
     400, "prompt"),
    ("tokenize: unknown field", TOKENIZE, {"prompt": "x", "bogus": 1}, None, 400, "bogus"),
    ("detokenize: an unknown field named by the empty string", DETOKENIZE, {"tokens": [], "": []}, None, 400, '""'),
    ("tokenize: unknown model", TOKENIZE, {"prompt": "x", "model": "nope"}, None, 404, "model"),
    ("tokenize: 1 MB prompt", TOKENIZE, {"prompt": "x" * 2**20}, None, 400, "prompt"),
    ("tokenize: messages empty", TOKENIZE, {"messages": []}, None, 400, "messages"),
    ("tokenize: a message role", TOKENIZE, {"messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("tokenize: continue_final_message with add_generation_prompt", TOKENIZE, {
        "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, None, 400,
     "continue_final_message"),
    ("tokenize: a lone surrogate", TOKENIZE, raw_json('{"prompt": "\\udfff"}'), None, 400, "prompt"),
    ("tokenize: not JSON", TOKENIZE, b"prompt=x", None, 400, None),
    ("detokenize: token id = vocab", DETOKENIZE, {"tokens": [1, 997]}, None, 400, "tokens"),
    ("detokenize: token id < 0", DETOKENIZE, {"tokens": [-1]}, None, 400, "tokens"),
    ("detokenize: token id 10^30", DETOKENIZE, {"tokens": [10**30]}, None, 400, "tokens"),
    ("detokenize: tokens a string", DETOKENIZE, {"tokens": "1 2"}, None, 400, "tokens"),
    ("detokenize: tokens missing", DETOKENIZE, {"model": "tiny"}, None, 400, "tokens"),
    ("detokenize: body over max_body_bytes", DETOKENIZE, b'{"tokens": [' + b"1," * BODY_LIMIT + b'1]}', None, 413,
     None),
    ("seed<0", C, OK | {"seed": -1}, None, 400, "seed"),
    ("seed=2^63", C, OK | {"seed": 2**63}, None, 400, "seed"),
    ("unknown field", C, OK | {"bogus_field": 1}, None, 400, "bogus_field"),
    ("unknown field, any spelling", C, OK | {"Max-Tokens": 1}, None, 400, "Max-Tokens"),
    ("unknown nested field", C, OK | {"diffusion": {"Mode": "ar"}}, None, 400, "diffusion.Mode"),
    ("unknown field named by the empty string", C, OK | {"": 1}, None, 400, '""'),
    ("threshold=0", C, OK | {"diffusion": {"threshold": 0}}, None, 400, "diffusion.threshold"),
    ("mode=x", C, OK | {"diffusion": {"mode": "x"}}, None, 400, "diffusion.mode"),
    ("max_denoising_steps=0", C, OK | {"diffusion": {"max_denoising_steps": 0}}, None, 400,
     "diffusion.max_denoising_steps"),
    ("stop: 5 strings", C, OK | {"stop": list("abcde")}, None, 400, "stop"),
    ("stop: 5 strings, chat", CHAT, OK_CHAT | {"stop": list("abcde")}, None, 400, "stop"),
    ("wrong type", C, OK | {"max_tokens": "many"}, None, 400, "max_tokens"),
    ("model not a string", C, OK | {"model": 5}, None, 400, "model"),
    ("unknown model", C, OK | {"model": "nope"}, None, 404, "model"),
    ("model missing", C, {"prompt": "hi"}, None, 400, "model"),
    ("messages empty", CHAT, OK_CHAT | {"messages": []}, None, 400, "messages"),
    ("message role", CHAT, OK_CHAT | {"messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("a tool message without its call", CHAT, OK_CHAT | {"messages": [{"role": "tool", "content": "x"}]}, None, 400,
     "messages[0]"),
    ("image part", CHAT, OK_CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None,
     400, "messages[0].content"),
    # sizes: prompts over max_model_len, token ids out of the vocabulary, huge max_tokens
    ("prompt > max_model_len", C, OK | {"prompt": "hello " * 200}, None, 400, "prompt"),
    ("prompt ids > max_model_len", C, OK | {"prompt": [1] + [300] * MAX_MODEL_LEN}, None, 400, "prompt"),
    ("chat > max_model_len", CHAT, OK_CHAT | {"messages": [{"role": "user", "content": "hi " * 200}]}, None, 400,
     "messages"),
    ("1 MB prompt", C, OK | {"prompt": "x" * 2**20}, None, 400, "prompt"),
    ("1 MB chat message", CHAT, OK_CHAT | {"messages": [{"role": "user", "content": "hi " * 2**18}]}, None, 400,
     "messages"),
    ("no room for a canvas, no max_tokens", C, {"model": MODEL, "prompt": [1] + [300] * 60}, None, 400, "prompt"),
    ("no room for a canvas, chat", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 45}]},
     None, 400, "messages"),
    ("token id = vocab", C, OK | {"prompt": [1, 997]}, None, 400, "prompt"),
    ("token id < 0", C, OK | {"prompt": [1, -1]}, None, 400, "prompt"),
    ("token id 10^30", C, OK | {"prompt": [10**30]}, None, 400, "prompt"),
    ("max_tokens 100000", C, OK | {"max_tokens": 100_000}, None, 400, "max_tokens"),
    ("max_tokens 10^30", C, OK | {"max_tokens": 10**30}, None, 400, "max_tokens"),
    ("max_completion_tokens 10^30", CHAT, OK_CHAT | {"max_completion_tokens": 10**30}, None, 400,
     "max_completion_tokens"),
    # numbers the shards' int64 / fp32 tensors cannot hold, or that mean nothing
    ("top_k 10^30", C, OK | {"top_k": 10**30}, None, 400, "top_k"),
    ("entropy_bound 1e308", C, OK | {"diffusion": {"policy": "entropy_bound", "entropy_bound": 1e308}}, None, 400,
     "diffusion.entropy_bound"),
    ("t_max 1e308", C, OK | {"diffusion": {"t_max": 1e308}}, None, 400, "diffusion.t_max"),
    ("t_min 1e300", C, OK | {"diffusion": {"t_min": 1e300}}, None, 400, "diffusion.t_min"),
    ("stability_threshold 10^30", C, OK | {"diffusion": {"stability_threshold": 10**30}}, None, 400,
     "diffusion.stability_threshold"),
    ("confidence_threshold 1e300", C, OK | {"diffusion": {"confidence_threshold": 1e300}}, None, 400,
     "diffusion.confidence_threshold"),
    ("max_denoising_steps 10^30", C, OK | {"diffusion": {"max_denoising_steps": 10**30}}, None, 400,
     "diffusion.max_denoising_steps"),
    # work: DiffusionGemma runs every step a request sets (a random one asked for 1234435 and held its slot
    # until the client gave up); each family answers a 400 above the server's limit
    ("max_denoising_steps > denoising_steps_limit", CHAT,
     OK_CHAT | {"diffusion": {"max_denoising_steps": STEPS_LIMIT + 1}}, None, 400, "diffusion.max_denoising_steps"),
    ("5000-digit integer", C, raw_json('{"model": "tiny", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"),
     None, 400, None),
    # NaN and Infinity: not JSON, but Python's json reads them
    ("temperature NaN", C, raw_json('{"model": "tiny", "prompt": "hi", "temperature": NaN}'), None, 400,
     "temperature"),
    ("top_p -Infinity", C, raw_json('{"model": "tiny", "prompt": "hi", "top_p": -Infinity}'), None, 400, "top_p"),
    ("entropy_bound Infinity", C, raw_json('{"model": "tiny", "prompt": "hi", "diffusion": {"entropy_bound": '
                                           'Infinity}}'), None, 400, "diffusion.entropy_bound"),
    ("t_max Infinity", C, raw_json('{"model": "tiny", "prompt": "hi", "diffusion": {"t_max": Infinity}}'), None, 400,
     "diffusion.t_max"),
    # OpenAI fields taken at their no-op values only: any other value would change the output
    ("presence_penalty", C, OK | {"presence_penalty": 0.5}, None, 400, "presence_penalty"),
    ("frequency_penalty", CHAT, OK_CHAT | {"frequency_penalty": -2}, None, 400, "frequency_penalty"),
    ("repetition_penalty", C, OK | {"repetition_penalty": 1.3}, None, 400, "repetition_penalty"),
    ("presence_penalty NaN", C, raw_json('{"model": "tiny", "prompt": "hi", "presence_penalty": NaN}'), None, 400,
     "presence_penalty"),
    ("presence_penalty a string", CHAT, OK_CHAT | {"presence_penalty": "0"}, None, 400, "presence_penalty"),
    ("min_p", C, OK | {"min_p": 0.05}, None, 400, "min_p"),
    ("logit_bias", C, OK | {"logit_bias": {"5": 100}}, None, 400, "logit_bias"),
    ("logit_bias a list", CHAT, OK_CHAT | {"logit_bias": [1]}, None, 400, "logit_bias"),
    ("logit_bias Infinity", CHAT, raw_json('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                          '"logit_bias": {"5": Infinity}}'), None, 400, "logit_bias"),
    ("best_of", C, OK | {"best_of": 2}, None, 400, "best_of"),
    ("suffix", C, OK | {"suffix": " the end"}, None, 400, "suffix"),
    ("response_format json_schema without one", CHAT, OK_CHAT | {"response_format": {"type": "json_schema"}}, None,
     400, "response_format"),
    ("response_format an unknown type", CHAT, OK_CHAT | {"response_format": {"type": "xml"}}, None, 400,
     "response_format.type"),
    ("response_format a schema of an unknown type", CHAT, OK_CHAT | {"response_format": {"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, None, 400, "response_format.json_schema.schema"),
    ("response_format a schema of an unknown format", C, OK | {"response_format": {"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "format": "color"}}}}, None, 400,
     "response_format.json_schema.schema"),
    ("structured_outputs and response_format", C, OK | {"response_format": {"type": "json_object"},
                                                        "structured_outputs": {"regex": "a+"}}, None, 400,
     "structured_outputs"),
    ("structured_outputs two constraints", C, OK | {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, None,
     400, "structured_outputs"),
    ("structured_outputs none", C, OK | {"structured_outputs": {}}, None, 400, "structured_outputs"),
    ("structured_outputs a bad regex", C, OK | {"structured_outputs": {"regex": "a(b"}}, None, 400,
     "structured_outputs.regex"),
    ("structured_outputs a bad grammar", CHAT, OK_CHAT | {"structured_outputs": {"grammar": "start: foo"}}, None,
     400, "structured_outputs.grammar"),
    ("structured_outputs json not JSON", C, OK | {"structured_outputs": {"json": "{nope"}}, None, 400,
     "structured_outputs.json"),
    ("a schema over the grammar's size limit", CHAT, OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {
            f"q{j}": {"type": "string", "pattern": "[a-z]{3,9}"} for j in range(40)}} for i in range(200)}}}}}, None,
     400, "response_format.json_schema.schema"),
    ("structured_outputs an empty choice", C, OK | {"structured_outputs": {"choice": []}}, None, 400,
     "structured_outputs.choice"),
    ("response_format a string", CHAT, OK_CHAT | {"response_format": "text"}, None, 400, "response_format"),
    ("tools not a list", CHAT, OK_CHAT | {"tools": {"type": "function"}}, None, 400, "tools"),
    ("a tool's name", CHAT, OK_CHAT | {"tools": [{"type": "function", "function": {"name": "a b"}}]}, None, 400,
     "tools[0].function.name"),
    ("tool_choice required without tools", CHAT, OK_CHAT | {"tool_choice": "required"}, None, 400, "tool_choice"),
    ("tool_choice a function not given", CHAT, OK_CHAT | {"tool_choice": {"type": "function", "function": {
        "name": "f"}}}, None, 400, "tool_choice"),
    ("functions", CHAT, OK_CHAT | {"functions": [{"name": "f"}]}, None, 400, "functions"),
    ("function_call", CHAT, OK_CHAT | {"function_call": {"name": "f"}}, None, 400, "function_call"),
    ("store", CHAT, OK_CHAT | {"store": True}, None, 400, "store"),
    ("modalities audio", CHAT, OK_CHAT | {"modalities": ["text", "audio"]}, None, 400, "modalities"),
    ("parallel_tool_calls not a bool", CHAT, OK_CHAT | {"parallel_tool_calls": "maybe"}, None, 400,
     "parallel_tool_calls"),
    # bodies that are not a JSON object, or not JSON, or not UTF-8, or too large
    ("body over max_body_bytes", C, b'{"model": "tiny", "prompt": "' + b"x" * BODY_LIMIT + b'"}', None, 413, None),
    ("deep JSON", C, b'{"model": "tiny", "prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
     400, None),
    ("deep JSON in a field", C, OK | {"stop": json.loads("[" * 500 + "]" * 500)}, None, 400, "stop"),
    ("non-UTF-8 bytes", C, b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}', None, 400, None),
    ("lone surrogate in prompt", C, raw_json('{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'), None, 400,
     "prompt"),
    ("lone surrogate in content", CHAT, raw_json('{"model": "tiny", "messages": [{"role": "user", '
                                                 '"content": "a\\udfffb"}]}'), None, 400, "messages[0].content"),
    ("lone surrogate in model", C, raw_json('{"model": "\\ud800", "prompt": "hi"}'), None, 400, "model"),
    ("lone surrogate in stop", C, raw_json('{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}'), None, 400,
     "stop"),
    ("not JSON", C, b"model=tiny&prompt=hi", None, 400, None),
    ("trailing garbage", C, b'{"model": "tiny", "prompt": "hi"} x', None, 400, None),
    ("empty body", C, b"", None, 400, None),
    ("JSON list", C, b'[{"model": "tiny", "prompt": "hi"}]', None, 400, None),
    ("JSON string", CHAT, b'"hi"', None, 400, None),
    ("text/plain", C, json.dumps(OK).encode(), "text/plain", 400, None),
    ("form content type", C, b"model=tiny&prompt=hi", "application/x-www-form-urlencoded", 400, None),
]


@pytest.mark.parametrize("app", ["nemotron", "gemma"])
def test_denoising_steps_up_to_the_limit_are_served(server, app):
    body = OK | {"ignore_eos": True, "diffusion": {"max_denoising_steps": STEPS_LIMIT, "confidence_threshold": 0}}
    r = post(server, app, C, body)
    check_response(r, C, body)
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["completion_tokens"] == OK["max_tokens"], r.text[:300]
    if app == "gemma":   # confidence_threshold 0: every one of the canvas's steps runs
        assert usage["diffusion"]["denoising_steps"] == STEPS_LIMIT, usage


@pytest.mark.parametrize("app", ["nemotron", "gemma"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_rejected_naming_the_field(server, app, case):
    _, path, body, content_type, status, param = case
    raw = body if isinstance(body, bytes) else None
    r = post(server, app, path, None if raw is not None else body, raw, content_type or "application/json")
    tally["known-bad requests"] += 1
    assert r.status_code == status, r.text[:300]
    assert_openai_error(r.json(), status, param)
    if param is None:  # only when the body is not a JSON object at all: nothing to name
        assert not isinstance(body, dict)
    else:   # the random fuzz's own check agrees (it once read an empty-string key's '""' as unnamed)
        check_response(r, path, body)


# OpenAI fields at the values that change nothing, as SDKs and chat front-ends send them by default
NO_OPS = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {},
          "user": "someone", "n": 1, "top_p": 1}
NO_OP_CASES = [(C, OK | NO_OPS | {"best_of": 1, "suffix": "", "echo": False, "logit_bias": {"7": 0}}),
               (CHAT, OK_CHAT | NO_OPS | {"response_format": {"type": "text"}, "parallel_tool_calls": True, "tools": [],
                                          "tool_choice": "none", "functions": [], "function_call": "none",
                                          "store": False, "modalities": ["text"], "logprobs": False}),
               (CHAT, OK_CHAT | {"parallel_tool_calls": False, "tool_choice": "auto"})]


@pytest.mark.parametrize("app", ["nemotron", "gemma"])
@pytest.mark.parametrize("path, body", NO_OP_CASES, ids=["completions", "chat", "chat, tool_choice auto"])
def test_openai_fields_at_their_no_op_values_are_served(server, app, path, body):
    r = post(server, app, path, body)
    check_response(r, path, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text[:300]


@pytest.mark.parametrize("app", ["nemotron", "gemma"])
@pytest.mark.parametrize("request_id", ["x" * 257, "two words", "caf\xe9"])
def test_a_malformed_request_id_is_a_400_naming_the_header(server, app, request_id):
    """(UTF-8 bytes: Ray Serve's proxy decodes the header as UTF-8, and answers other bytes with its own
    500 before any app sees the request.)"""
    r = post(server, app, C, OK, headers={"x-request-id": request_id.encode()})
    tally["known-bad requests"] += 1
    assert r.status_code == 400, r.text[:300]
    assert_openai_error(r.json(), 400, "X-Request-Id")


# ---- generated from the served OpenAPI schema ----------------------------------------------------

def _served_model(drawn):
    """Most generated bodies name the served model, so valid ones reach the engine (the rest check the
    404 of an unknown model)."""
    case, served = drawn
    if served and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def fuzz_post(client, path: str, mode: GenerationMode, draw: str, counted_as: str) -> None:
    """POST bodies generated from the served schema of `path` (with or without the served model's name),
    each answered as check_response expects."""
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    operation = schema[path]["POST"]

    @settings(max_examples=FUZZ_EXAMPLES[draw], deadline=None, database=None, derandomize=draw == "fixed",
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.tuples(operation.as_strategy(generation_mode=mode), st.integers(0, 3).map(bool)).map(_served_model))
    def run(case):
        body = case.body if isinstance(case.body, (dict, list, str, int, float, bool)) else None
        check_response(send(client, case.as_transport_kwargs(base_url="")), path, body, case.headers)
        tally[counted_as] += 1

    run()


@pytest.mark.parametrize("draw", ["fixed", pytest.param("random", marks=pytest.mark.reliability)])
@pytest.mark.parametrize("mode", [GenerationMode.NEGATIVE, GenerationMode.POSITIVE], ids=["invalid", "valid"])
@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("app", ["nemotron", "gemma"])
def test_requests_generated_from_the_served_schema(server, app, path, mode, draw):
    fuzz_post(server[app], path, mode, draw, f"generated {mode.value}")


@pytest.mark.parametrize("draw", ["fixed", pytest.param("random", marks=pytest.mark.reliability)])
@pytest.mark.parametrize("mode", [GenerationMode.NEGATIVE, GenerationMode.POSITIVE], ids=["invalid", "valid"])
@pytest.mark.parametrize("path", [TOKENIZE, DETOKENIZE])
def test_tokenizer_requests_generated_from_the_served_schema(server, path, mode, draw):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize, on the family whose
    template writes a generation prompt: never a 5xx; a 4xx names the field."""
    fuzz_post(server["gemma"], path, mode, draw, f"generated {path} {mode.value}")


@pytest.mark.parametrize("draw", ["fixed", pytest.param("random", marks=pytest.mark.reliability)])
@pytest.mark.parametrize("mode", [GenerationMode.NEGATIVE, GenerationMode.POSITIVE], ids=["invalid", "valid"])
def test_model_ids_generated_from_the_served_schema(server, mode, draw):
    """GET /v1/models/{model_id} with generated ids (and X-Request-Id headers): the served model's card, or
    an OpenAI-shaped 404 (400 for a malformed X-Request-Id); never a 5xx."""
    client = server["nemotron"]
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    operation = schema["/v1/models/{model_id}"]["GET"]

    @settings(max_examples=FUZZ_EXAMPLES[draw] // 2, deadline=None, database=None, derandomize=draw == "fixed",
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        r = send(client, case.as_transport_kwargs(base_url=""))
        tally[r.status_code] += 1
        assert r.status_code in (200, 400, 404), f"{r.status_code} for {case.path_parameters}: {r.text[:300]}"
        if r.status_code == 200:
            assert r.json()["id"] == MODEL == case.path_parameters["model_id"]
        else:
            assert_openai_error(r.json(), r.status_code)
        tally[f"generated model ids {mode.value}"] += 1

    run()
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL


def test_no_bad_input_failed_a_shard(server):
    """After every bad input above: healthy, no shard failure, every slot free, and a normal answer."""
    for app, path, body in [("nemotron", C, OK), ("gemma", C, OK), ("nemotron", CHAT, OK_CHAT)]:
        h = health(server, app).json()
        assert h["shard_failures"] == 0 and h["free_slots"] == h["num_slots"] and h["kv_cache_usage"] == 0, h
        r = post(server, app, path, body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_diffusion_gemma_schedule_is_checked_against_the_checkpoint(server):
    """The tiny checkpoint's generation_config.json has t_min 0.4, t_max 0.8: one end given alone must
    still leave t_max > t_min, checked at the ingress (else the shard's own check fails the step)."""
    for diffusion, param in [({"t_max": 0.3}, "diffusion.t_max"), ({"t_min": 0.9}, "diffusion.t_max")]:
        r = post(server, "gemma", C, OK | {"diffusion": diffusion})
        assert r.status_code == 400, r.text[:300]
        assert_openai_error(r.json(), 400, param)
    assert health(server, "gemma").json()["shard_failures"] == 0
    assert post(server, "gemma", C, OK | {"diffusion": {"t_max": 0.5}}).status_code == 200
