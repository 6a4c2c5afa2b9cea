"""Chat tool calls (docs/api.md#tool-calls): the grammar that makes a model's answer a valid call of the
request's tools, in the format of the checkpoint's chat template, and the parse of an answer into OpenAI's
`tool_calls`.

Formats, chosen from the tokenizer's vocabulary:
- `mistral`: the template's `[TOOL_CALLS]` special token; with `[ARGS]` in the vocabulary (Mistral's
  tokenizer v11 and later, Ministral 3's) each call is `[TOOL_CALLS]name[ARGS]{arguments}`; without it, one
  `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
- `json`: a template with no tool syntax: the answer is one `{"name": ..., "arguments": {...}}` object (an
  array of them where parallel calls are allowed).
A call's arguments follow its function's `parameters` schema. With tool_choice "auto", a marker format lets
the answer be free text or calls (special tokens never occur in text); the `json` format leaves the text
free and reads a call only where the whole answer is a valid one.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

import jsonschema

from model.grammar.compile import JSON_DEFAULTS, GrammarRequest


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's shape: a message's call, or with its index a streamed delta's."""
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _json(schema: dict) -> str:
    """A Lark `%json` rule's schema, compact as model/grammar/compile.py's JSON (its own x-guidance wins)."""
    return "%json " + json.dumps({"x-guidance": JSON_DEFAULTS, **schema})


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


class ToolFormat:
    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.calls_id, self.args_id = vocab.get("[TOOL_CALLS]"), vocab.get("[ARGS]")
        self.name = "json" if self.calls_id is None else "mistral"
        self.tokenizer = tokenizer

    def grammar(self, tools: list[dict], choice: str, parallel: bool, field: str) -> GrammarRequest | None:
        """The constraint for `choice` ("auto", "required" or a function's name) over `tools` (OpenAI's
        function definitions), None where the answer stays free (`json`'s auto)."""
        fns = [t["function"] for t in tools]
        if choice not in ("auto", "required"):
            fns = [f for f in fns if f["name"] == choice]
            parallel = False
        if self.name == "json":
            if choice == "auto":
                return None
            call = {"anyOf": [_call_schema(f) for f in fns]} if len(fns) > 1 else _call_schema(fns[0])
            schema = {"type": "array", "items": call, "minItems": 1} if parallel else call
            return GrammarRequest("grammar", f"start: call\ncall: {_json(schema)}", field)
        more = " call*" if parallel else ""
        if self.args_id is not None:
            rules = " | ".join(f"{json.dumps(f['name'])} <[{self.args_id}]> args{i}" for i, f in enumerate(fns))
            defs = "\n".join(f"args{i}: {_json(f.get('parameters') or {'type': 'object'})}" for i, f in enumerate(fns))
            calls = f"calls: call{more}\ncall: <[{self.calls_id}]> ({rules})\n{defs}"
        else:
            items = {"anyOf": [_call_schema(f) for f in fns]}
            array = {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            calls = f"calls: <[{self.calls_id}]> array\narray: {_json(array)}"
        start = "start: TEXT | calls\nTEXT: /(?s:.*)/" if choice == "auto" else "start: calls"
        return GrammarRequest("grammar", f"{start}\n{calls}", field)

    def parse(self, token_ids: list[int], text: str, tools: list[dict]) -> list[ToolCall] | None:
        """The calls an answer makes (None: it is text)."""
        fns = {t["function"]["name"]: t["function"] for t in tools}
        if self.name == "json":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return None
            calls = value if isinstance(value, list) else [value]
            try:
                for c in calls:
                    jsonschema.validate(c, _call_schema(fns[c["name"]]))
            except (KeyError, TypeError, jsonschema.ValidationError):
                return None
            return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls] or None
        if self.calls_id not in token_ids:
            return None
        raw = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        marker = self.tokenizer.convert_ids_to_tokens(self.calls_id)
        body = raw[raw.index(marker):]
        if self.args_id is not None:
            args = re.escape(self.tokenizer.convert_ids_to_tokens(self.args_id))
            eos = "|".join(re.escape(t) for t in self.tokenizer.all_special_tokens)
            found = re.findall(re.escape(marker) + f"(.*?){args}(.*?)(?={re.escape(marker)}|{eos}|$)", body, re.S)
            return [ToolCall(name, json.dumps(json.loads(a))) for name, a in found] or None
        array = json.JSONDecoder().raw_decode(body[len(marker):])[0]
        return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in array] or None
