"""Constrained decoding: a random-weight model under a grammar still writes only what the grammar allows.

Random weights put probability on every token, so whatever the tiny model writes is the grammar's doing; the
schemas bound their strings, numbers and arrays so that ``max_tokens`` suffices to finish them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from shared.grammar import GrammarSpec, json_schema_text
from tests.engine.helpers import drain
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.grammar import apply_token_bitmask
from worker.engine.spec_draft import write_truncated_draft

PROMPT = [1, 422, 3837, 314, 260, 4519]

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["n", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "role": {"enum": ["admin", "guest"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1,
                   "maxItems": 2}},
     "required": ["user", "scores"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"},
                                      "xy": {"type": "array", "items": {"type": "integer", "minimum": -9,
                                                                        "maximum": 9},
                                             "minItems": 2, "maxItems": 2}},
     "required": ["kind", "xy"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"],
                "additionalProperties": False},
               {"type": "object", "properties": {"b": {"enum": [1, 2, 3]}}, "required": ["b"],
                "additionalProperties": False}]},
]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=8, num_kv_blocks=128,
                               max_num_seqs=16))


def _schema_params(schema: dict, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=200, grammar=GrammarSpec("json_schema", json_schema_text(schema)), **kwargs)


def test_json_schemas_hold_under_random_weights(engine: Engine) -> None:
    """Every schema, greedy and sampled, in one batch: each output parses and validates, ending with "stop"."""
    params = [_schema_params(s, temperature=t, seed=i) for i, s in enumerate(SCHEMAS) for t in (0.0, 1.0)]
    outputs = engine.generate([PROMPT] * len(params), params)
    for out, p in zip(outputs, params, strict=True):
        assert out.finish_reason == "stop", out.text
        assert p.grammar is not None
        jsonschema.validate(json.loads(out.text), json.loads(p.grammar.value))


def test_json_object_regex_and_lark(engine: Engine) -> None:
    obj, date, choice = engine.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=300, temperature=0.0, grammar=GrammarSpec("json_object")),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, grammar=GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}")),
        SamplingParams(max_tokens=30, grammar=GrammarSpec("lark", 'start: "yes" | "no" | "maybe"')),
    ])
    if obj.finish_reason == "stop":  # a random model may nest deeper than any budget; a finished one is valid
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text) and date.finish_reason == "stop"
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"


def test_invalid_grammar_is_refused_at_add_request(engine: Engine) -> None:
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("bad", PROMPT, SamplingParams(grammar=GrammarSpec("lark", "start: undefined_rule")))
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar=GrammarSpec("yaml", "x"))  # type: ignore[arg-type]
    assert not engine.has_unfinished()


def test_grammar_survives_preemption_and_groups(tiny_llama: Path) -> None:
    """A KV pool too small for the batch preempts (recompute) constrained requests; n choices each obey."""
    small = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=4, num_kv_blocks=24,
                                max_num_seqs=6))
    schema = SCHEMAS[3]
    params = _schema_params(schema, temperature=1.0, seed=7)
    small.add_request_group([f"g{i}" for i in range(4)], PROMPT, params)
    small.add_request("solo", PROMPT, _schema_params(SCHEMAS[2], temperature=0.0))
    run = drain(small)
    assert small.stats().num_preemptions > 0
    for rid, event in run.finished.items():
        assert event.finish_reason == "stop", run.text[rid]
        jsonschema.validate(json.loads(run.text[rid]), schema if rid != "solo" else SCHEMAS[2])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_grammar_with_speculation(tiny_llama: Path, tmp_path: Path, method: str) -> None:
    """Proposals are cut to what the grammar accepts and verification keeps only allowed tokens (the draft model's
    sampled proposals go through rejection sampling against the masked target distribution)."""
    draft = str(write_truncated_draft(tiny_llama, tmp_path / "draft", num_layers=1)) if method == "draft" else None
    spec = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=8, num_kv_blocks=128,
                               max_num_seqs=8, speculative_method=method, draft_model=draft,
                               num_speculative_tokens=3))
    # A prompt that repeats JSON-ish text so the n-gram proposer has something to propose.
    prompt = spec.tokenizer.encode('{"colour":"red","ok":true} {"colour":"red","ok":true} {"colour":"')
    params = [_schema_params(SCHEMAS[1], temperature=t, seed=1) for t in (0.0, 1.0)]
    outputs = spec.generate([prompt, prompt], params)
    for out in outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    if method == "ngram":  # a random draft model's proposals break the grammar at once: all are cut away
        stats = spec.stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # speculation took part


def test_apply_token_bitmask_masks_exactly_the_cleared_bits() -> None:
    logits = torch.zeros(2, 40)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 1] = 1 << 7  # token 39
    bitmask[1, 0] = -(2**31)  # bit 31: token 31 (the sign bit)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [31, 39]
