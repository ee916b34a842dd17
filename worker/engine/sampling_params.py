"""Per-request sampling parameters, validated once at the engine boundary.

Field names equal those of ``shared.schemas.GenerationParams`` so the worker converts a wire job with
``SamplingParams(**params.model_dump())``.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 is off. ``logprobs``: None = off, 0 = the chosen
    token's log-probability only, N = the chosen token plus the top-N alternatives. ``seed`` gives the request
    its own random generator, so its output does not depend on what else is in the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists from JSON become tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "-1, 0 (off) or a positive count", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"in [0, max_tokens={self.max_tokens}]",
               self.min_tokens)
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "None or in [0, 20]", self.logprobs)
        _check(all(s for s in self.stop), "stop", "non-empty strings", self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
