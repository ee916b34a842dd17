"""The raw bytes of a token, for logprobs: a token that holds part of a multi-byte character decodes to U+FFFD on
its own, so its text cannot say which bytes it carries (OpenAI's ``bytes`` field, completions' ``text_offset``).

Byte-level BPE vocabularies (GPT-2 style: SmolLM2, Llama 3, Qwen2) spell each byte as one printable character;
SentencePiece vocabularies with byte fallback spell single bytes as ``<0xNN>``. Anything else (special tokens,
word-level vocabularies) is its decoded text in UTF-8.
"""

from __future__ import annotations

import re

from transformers.convert_slow_tokenizer import bytes_to_unicode

from worker.port import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """``bytes_of(token_id)`` for one tokenizer (built once: it inspects the tokenizer's decoder)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._char_to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()))

    def bytes_of(self, token_id: int) -> bytes:
        if token_id not in self._special_ids:
            piece = self._piece(token_id)
            if piece is not None:
                if self._byte_level and all(c in self._char_to_byte for c in piece):
                    return bytes(self._char_to_byte[c] for c in piece)
                if match := _BYTE_FALLBACK.fullmatch(piece):
                    return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id]).encode()

    def _piece(self, token_id: int) -> str | None:
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else None
        return piece if isinstance(piece, str) else None
