"""Per-request sampling parameters, validated once at the engine boundary.

Field names equal those of ``shared.schemas.GenerationParams`` so the worker converts a wire job with
``SamplingParams(**params.model_dump())``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.grammar import GrammarSpec
from shared.sampling import EARLY_STOPPING_VALUES, SAMPLING_RANGES, beam_search_conflict, is_greedy


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy (so is any temperature below ``shared.sampling.GREEDY_BELOW_TEMPERATURE``).
    ``top_k`` of 0 or -1 is off. ``logprobs``: None = off, 0 = the chosen token's log-probability only, N = the
    chosen token plus the top-N alternatives. ``seed`` gives the request its own random generator, so its output
    does not depend on what else is in the batch. Every numeric field must lie in its range in
    ``shared.sampling.SAMPLING_RANGES`` (ValueError naming the field otherwise). ``beam_width > 1`` asks for beam
    search, with the restrictions of ``shared.sampling.beam_search_conflict``.
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
    # Beam search (worker.engine.beam) when beam_width > 1, with transformers' length_penalty and early_stopping.
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    grammar: GrammarSpec | None = None  # constrained decoding (worker.engine.grammar); a dict from JSON is converted

    def __post_init__(self) -> None:
        if isinstance(self.grammar, dict):
            object.__setattr__(self, "grammar", GrammarSpec(**self.grammar))
        _check(self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar", "a GrammarSpec or None",
               self.grammar)
        # Lists from JSON become tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name, allowed in SAMPLING_RANGES.items():
            value = getattr(self, name)
            for item in value if isinstance(value, tuple) else (value,):
                if item is not None:
                    allowed.check(name, item)
        _check(self.min_tokens <= self.max_tokens, "min_tokens", f"at most max_tokens={self.max_tokens}",
               self.min_tokens)
        _check(all(s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(any(self.early_stopping is v for v in EARLY_STOPPING_VALUES) or self.early_stopping == "never",
               "early_stopping", 'true, false or "never"', self.early_stopping)
        conflict = beam_search_conflict(vars(self))
        if conflict is not None:
            raise ValueError(f"{conflict[0]} {conflict[1]}, got {getattr(self, conflict[0])!r}")

    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: temperature 0, or one so small that dividing by it would overflow (shared.sampling)."""
        return is_greedy(self.temperature)

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1
