"""OpenAI ``response_format`` and vLLM's structured-output extras, as the job's grammar (``shared.schemas.Grammar``).

Accepted, one at a time:
- ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. The schema is
  enforced whether or not ``strict`` is set (the grammar always holds).
- vLLM's ``guided_json`` (a schema, object or JSON text), ``guided_regex``, ``guided_choice`` (a list of strings),
  ``guided_grammar`` (a Lark grammar, llguidance's dialect), and the same as ``structured_outputs``
  (``{"json": ..., "regex": ..., "choice": [...], "grammar": ..., "json_object": true}``).
A grammar that does not compile is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from api.errors import invalid_request
from shared.grammar import json_schema_text
from shared.schemas import Grammar

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                    "grammar": "guided_grammar"}


def grammar_of(response_format: dict[str, Any] | None, extras: dict[str, Any]) -> Grammar | None:
    """The one grammar a request asks for (``extras``: the guided_* fields and ``structured_outputs``), or None."""
    asked = {name: value for name, value in extras.items() if value is not None}
    structured = asked.pop("structured_outputs", None)
    if structured is not None:
        asked.update(_from_structured_outputs(structured))
    from_format = _from_response_format(response_format)
    if from_format is not None:
        asked["response_format"] = from_format
    if len(asked) > 1:
        raise invalid_request(f"only one of response_format, structured_outputs or guided_* may be given, got "
                              f"{', '.join(sorted(asked))}", param=sorted(asked)[1])
    if not asked:
        return None
    (param, value), = asked.items()
    return value if isinstance(value, Grammar) else _from_guided(param, value)


def json_schema_grammar(schema: object, param: str) -> Grammar:
    """A ``json_schema`` grammar for ``schema`` (an object, or JSON text of one); 400 naming ``param`` if invalid."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise invalid_request("must be a JSON schema (an object or its JSON text)", param=param) from None
    if not isinstance(schema, dict):
        raise invalid_request("must be a JSON schema (an object)", param=param)
    return _grammar("json_schema", json_schema_text(schema), param)


def _grammar(kind: str, value: str, param: str) -> Grammar:
    try:
        return Grammar(kind=kind, value=value)
    except (ValidationError, ValueError) as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else [{"msg": str(exc)}]
        raise invalid_request(f"{param} is not a usable grammar: {errors[0]['msg']}"[:1000], param=param) from None


def _from_response_format(response_format: dict[str, Any] | None) -> Grammar | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar("json_object", "", "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid_request("response_format json_schema needs json_schema.schema",
                                  param="response_format.json_schema")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise invalid_request("response_format type must be text, json_object or json_schema",
                          param="response_format.type")


def _from_structured_outputs(structured: Any) -> dict[str, Any]:
    if not isinstance(structured, dict):
        raise invalid_request("structured_outputs must be an object", param="structured_outputs")
    given = {k: v for k, v in structured.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_STRUCTURED_KEYS) - {"json_object"})
    if unknown:
        raise invalid_request(f"structured_outputs.{unknown[0]} is not supported (supported: json, regex, "
                              "choice, grammar, json_object)", param=f"structured_outputs.{unknown[0]}")
    out: dict[str, Any] = {_STRUCTURED_KEYS[k]: v for k, v in given.items() if k in _STRUCTURED_KEYS}
    if given.get("json_object"):
        out["structured_outputs.json_object"] = _grammar("json_object", "", "structured_outputs")
    return out


def _from_guided(param: str, value: Any) -> Grammar:
    if param == "guided_json":
        return json_schema_grammar(value, param)
    if param == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid_request("guided_choice must be a non-empty list of non-empty strings", param=param)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return _grammar("lark", f"start: {alternatives}", param)
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param} must be a non-empty string", param=param)
    return _grammar("regex" if param == "guided_regex" else "lark", value, param)
