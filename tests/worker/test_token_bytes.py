"""Logprobs of multi-byte characters carry each token's own bytes (issue 17, item 9): SmolLM2's real byte-level
tokenizer splits an emoji over three tokens, each of which decodes to U+FFFD alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from api.openai_format import chat_logprobs, completion_logprobs
from shared.schemas import TokenLogprob
from worker.engine import Logprob
from worker.jobs import to_token_logprobs
from worker.token_bytes import TokenBytes

TEXT = "😀 é!"


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(smollm2)


def test_tokens_carry_their_own_bytes(tokenizer: AutoTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    token_bytes = TokenBytes(tokenizer)
    pieces = [token_bytes.bytes_of(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode()
    assert len(ids) > 3 and all(p != "\ufffd".encode() for p in pieces)
    assert token_bytes.bytes_of(tokenizer.eos_token_id) == tokenizer.eos_token.encode()  # special: its text


def test_openai_logprobs_use_the_bytes_and_count_offsets_in_characters(tokenizer: AutoTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    engine_lps = [Logprob(i, -0.5, ((i, -0.5),)) for i in ids]
    wire = to_token_logprobs(engine_lps, tokenizer, TokenBytes(tokenizer))
    assert [bytes(lp.bytes or []) for lp in wire] == [TokenBytes(tokenizer).bytes_of(i) for i in ids]
    chat = chat_logprobs(wire).content or []
    assert b"".join(bytes(c.bytes or []) for c in chat) == TEXT.encode()
    assert [bytes(c.top_logprobs[0].bytes or []) for c in chat] == [bytes(c.bytes or []) for c in chat]
    offsets = completion_logprobs(wire).text_offset
    # The emoji's three tokens all start at character 0; " é" starts at 1 and "!" at 3 (Python characters).
    starts = [len(b"".join(bytes(lp.bytes or []) for lp in wire[:k]).decode(errors="ignore")) for k in range(len(wire))]
    assert offsets == starts and offsets[0] == offsets[1] == offsets[2] == 0 and offsets[-1] == len(TEXT) - 1


def test_records_without_bytes_fall_back_to_the_text() -> None:
    old = TokenLogprob(token_id=5, token="hé", logprob=-1.0)
    assert chat_logprobs([old]).content[0].bytes == list("hé".encode())  # type: ignore[index]
