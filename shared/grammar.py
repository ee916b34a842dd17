"""Grammars that constrain a job's output: the one vocabulary of grammar kinds, and their compilation.

A grammar travels as ``(kind, value)`` (``shared.schemas.GrammarSpec`` on the wire, the engine's
``worker.engine.grammar.GrammarSpec`` inside): a JSON schema (as JSON text), any JSON object, a regular
expression, or a Lark grammar (llguidance's dialect, which may embed JSON schemas with ``%json {...}``).
Both the API (to refuse a bad grammar with a 400) and the engine (to build a matcher) compile it here with
llguidance, so the two agree on what is valid. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
MAX_GRAMMAR_CHARS = 200_000  # a schema or grammar larger than this is refused (its compilation cost grows with it)

# Compact JSON (no whitespace between tokens): a flexible-whitespace grammar lets a weak model emit blanks forever.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` in ``GRAMMAR_KINDS``, ``value`` its text ("" for json_object).

    The engine's form (``SamplingParams.grammar``); ``shared.schemas.Grammar`` is the wire form with the same fields.
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar.kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"grammar.value must be a string, got {type(self.value).__name__}")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LITERALS = ("const", "enum", "default", "examples", "required")


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties`` and says
    nothing of extra ones (xgrammar's "strict mode", vLLM's default; OpenAI's strict schemas spell it out): without
    it a grammar lets a model add keys without end."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> subschema, not a schema itself
            closed[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key in _LITERALS:
            closed[key] = value
        else:
            closed[key] = close_objects(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "unevaluatedProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def llguidance_grammar(kind: str, value: str) -> str:
    """The llguidance grammar for ``(kind, value)``; ValueError naming ``grammar`` when it cannot be built."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"grammar.kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"grammar.value must be at most {MAX_GRAMMAR_CHARS} characters, got {len(value)}")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"grammar.value must be a JSON schema in JSON text: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("grammar.value must be a JSON schema (a JSON object)")
        return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    return llguidance.LLMatcher.grammar_from_lark(value)


def check_grammar(kind: str, value: str) -> str:
    """The compiled grammar when valid, else ValueError with llguidance's reason (no tokenizer needed)."""
    grammar = llguidance_grammar(kind, value)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"grammar ({kind}) is invalid: {error}"[:1000])
    return grammar


def json_schema_text(schema: object) -> str:
    """A schema as the compact JSON text a ``json_schema`` grammar carries."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
