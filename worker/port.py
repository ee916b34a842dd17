"""What the worker needs of an engine: a typed port. ``worker.engine.Engine`` implements it; tests run the real
worker over a scripted engine that implements it too (tests/worker/scripted_engine.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from worker.engine import EngineStats, SamplingParams, StepOutput


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the worker uses."""

    chat_template: str | None
    special_tokens_map: dict[str, Any]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def __call__(self, text: str, **kwargs: Any) -> Any: ...


class EnginePort(Protocol):
    """An engine as the worker drives it, always from one thread (``worker.engine_thread``)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens at most."""

    @property
    def vocab_size(self) -> int:
        """Token ids the engine accepts: [0, vocab_size)."""

    @property
    def eos_token_ids(self) -> list[int]: ...

    def add_request_group(self, request_ids: Sequence[str], prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0) -> None:
        """A job's ``n`` choices, all or none; ValueError (naming the field) for input the engine refuses."""

    def step(self) -> list[StepOutput]:
        """One step; what happened to each request it advanced (a failed request ends with ``error``)."""

    def abort(self, request_id: str) -> bool: ...

    def free_seats(self) -> int:
        """How many more requests it takes right now."""

    def stats(self) -> EngineStats: ...
