"""What a request's structured-output field asks for, as an llguidance grammar, checked against the served
tokenizer within bounds of size and work (docs/spec.md 12).

llguidance (not a hand-written parser) compiles JSON Schema, regular expressions and Lark/GBNF grammars to
token masks; it is chosen over xgrammar for its small CPU wheel with no torch dependency, its lazy lexer (no
whole-vocabulary precompute per grammar, so a new schema costs little) and a matcher that validates a run
of tokens and rolls back, which is what checking a canvas left to right needs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from model.sampling.params import ParamError

# JSON as compact as JSON allows (separators "," and ":", no free whitespace): a canvas spends no positions on
# layout, and a weak model cannot wander in whitespace. A schema's own "x-guidance" options override it.
JSON_DEFAULTS = {"whitespace_flexible": False}
# The most symbols a grammar may have, and the lexer's work: a pathological schema fails with a 400, it does not
# stall a shard. llguidance's defaults but a tenth of the grammar size.
LIMITS = {"max_grammar_size": 50_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "step_max_items": 50_000, "max_lexer_states": 250_000}


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


@dataclass(frozen=True)
class GrammarRequest:
    """One constraint as a request gives it: its kind (json_schema, json_object, regex, choice, grammar), the
    value, and the request field that carried it (what a 400 names)."""
    kind: str
    value: Any
    field: str

    def key(self) -> str:
        """The cache key: the kind and the value's canonical JSON."""
        return json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"))


def grammar_text(req: GrammarRequest) -> str:
    """The llguidance grammar of `req` (not yet checked); ParamError naming its field if the value is not
    one of its kind at all."""
    match req.kind:
        case "json_schema":
            if not isinstance(req.value, dict):
                raise ParamError(f"{req.field}: a JSON schema is an object", req.field)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(req.value, defaults=JSON_DEFAULTS)
            except ValueError as err:
                raise ParamError(f"{req.field}: {err}", req.field) from None
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(req.value)
        case "choice":
            if not req.value or not all(isinstance(c, str) and c for c in req.value):
                raise ParamError(f"{req.field}: a choice is a non-empty list of non-empty strings", req.field)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in req.value))
        case "grammar":
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(req.value)
            except Exception as err:   # the converter's own errors name the GBNF position
                raise ParamError(f"{req.field}: {err}", req.field) from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"unknown grammar kind {req.kind!r}")


def check_grammar(req: GrammarRequest, tokenizer: llguidance.LLTokenizer) -> str:
    """The grammar of `req`, checked against `tokenizer` within LIMITS; ParamError naming the request's field
    and llguidance's reason (an unsupported schema feature, a regex or grammar syntax error, a grammar too
    large). Runs llguidance's compiler: call it off the event loop."""
    text = grammar_text(req)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer, limits=parser_limits())
    if is_error:
        raise ParamError(f"{req.field}: {messages[0].strip()}", req.field)
    return text
