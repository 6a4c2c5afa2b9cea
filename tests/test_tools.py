"""Chat tool calls through the real `openai` client (the app in this process: tests/inprocess.py): on a
checkpoint whose template has no tool syntax (the `json` format) and on one with Mistral's `[TOOL_CALLS]` /
`[ARGS]` tokens (deployments/tools.py); "required" and a named function always give valid calls, "auto"
gives text or valid calls, streamed calls equal whole ones, a conversation sends calls and their results
back; the tiny random model writes noise, so every valid call is the constraint's doing."""
import json
import shutil

import jsonschema
import openai
import pytest

from model.tiny import MISTRAL_STYLE_CHAT_TEMPLATE, NEMOTRON_LD_SPECIAL_TOKENS
from model.tiny_tokenizer import build_tiny_tokenizer
from tests.inprocess import inprocess_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A Mistral-style template that renders the tools, an assistant's calls and the tools' answers
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role in ('user', 'system') %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]"
    "{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}")
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def tool_checkpoint(tiny_nemotron, tmp_path_factory):
    """The tiny checkpoint with two reserved ids as Mistral's tool tokens and a template that uses them."""
    out = shutil.copytree(tiny_nemotron, tmp_path_factory.mktemp("tiny-tools") / "ckpt")
    config = json.loads((out / "config.json").read_text())
    specials = dict(NEMOTRON_LD_SPECIAL_TOKENS) | {5: "[TOOL_CALLS]", 6: "[ARGS]"}
    build_tiny_tokenizer(out, vocab_size=config["vocab_size"], special_tokens=specials, bos_token="<s>",
                         eos_token="</s>", pad_token=None, mask_token="<|mask|>", chat_template=TOOLS_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def clients(tiny_nemotron, tool_checkpoint):
    common = dict(served_model_name="tiny", max_model_len=512, max_num_seqs=8)
    with inprocess_app(tiny_nemotron, **common) as plain, inprocess_app(tool_checkpoint, **common) as mistral:
        yield {name: openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=c)
               for name, c in (("json", plain), ("mistral", mistral))}


def assert_valid_calls(message, names=None, most: int | None = None) -> list:
    calls = message.tool_calls
    assert calls and message.content is None
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and (names is None or c.function.name in names)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert most is None or len(calls) <= most
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


# parallel calls: the json format's array closes; Mistral's calls, each behind its own token, may go on as
# long as the noise-writing model does not pick EOS, so that format's test asks for one
@pytest.mark.parametrize("fmt, parallel", [("json", True), ("mistral", False)])
def test_required_and_named_choices_always_give_valid_calls(clients, fmt, parallel):
    c = clients[fmt]
    for seed in range(4):
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
                                      temperature=1.0, max_completion_tokens=96, parallel_tool_calls=parallel)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert_valid_calls(r.choices[0].message, most=None if parallel else 1)
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      parallel_tool_calls=False, max_completion_tokens=96)
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(r.choices[0].message, {"get_time"}, most=1)
    # in AR mode and in linear speculation (greedy) too
    for mode in ("ar", "linear_spec"):
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                      max_completion_tokens=96, parallel_tool_calls=parallel,
                                      extra_body={"diffusion": {"mode": mode}})
        assert r.choices[0].finish_reason == "tool_calls", (mode, r.choices[0])
        assert_valid_calls(r.choices[0].message, most=None if parallel else 1)


@pytest.mark.parametrize("fmt", ["json", "mistral"])
def test_streamed_calls_equal_whole_ones(clients, fmt):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=7, temperature=1.0,
              max_completion_tokens=96, parallel_tool_calls=fmt == "json")
    whole = assert_valid_calls(clients[fmt].chat.completions.create(**kw).choices[0].message)
    chunks = list(clients[fmt].chat.completions.create(stream=True, **kw))
    deltas = [call for ch in chunks if ch.choices for call in ch.choices[0].delta.tool_calls or ()]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == whole
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)


def test_auto_gives_text_or_valid_calls(clients):
    """With the tool tokens, "auto" lets the answer be text (no tool token in it) or calls, each valid."""
    kinds = set()
    for seed in range(10):
        r = clients["mistral"].chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed,
                                                       temperature=1.0, max_completion_tokens=64)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            assert_valid_calls(choice.message)
            kinds.add("calls")
        else:
            assert choice.message.tool_calls is None and "[TOOL_CALLS]" not in choice.message.content
            kinds.add("text")
    assert kinds   # which of the two a seed gives is the model's choice


def test_a_conversation_sends_calls_and_their_results_back(clients):
    c = clients["mistral"]
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
                                  temperature=1.0, max_completion_tokens=96, parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'}]
    r = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", seed=1,
                                  max_completion_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 40   # the template rendered the tools, the call and its result


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop"),   # a stop could cut a call short
])
def test_bad_tool_requests_are_400s_naming_the_field(clients, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        clients["json"].chat.completions.create(**({"model": "tiny", "messages": ASK, "max_completion_tokens": 8}
                                                   | body))
    assert err.value.body["param"] == param, err.value.body
