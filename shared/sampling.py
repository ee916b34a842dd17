"""The allowed range of every numeric sampling field: one definition for the API, the job schema and the engine.

Each range is one that the engine can honour on every dtype it runs (fp32, bf16, fp16): no accepted value can
overflow a tensor, divide by a subnormal or turn a logit row into NaN. ``shared.schemas.GenerationParams``
builds its pydantic constraints from these ranges (so the API's 400 names the field) and the engine's
``SamplingParams`` checks the same ranges (so a job pushed straight into Redis fails its own job, not a step).
Nothing here imports torch or pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

# A temperature above 0 but below this is sampled greedily (the limit of sampling as the temperature goes to 0):
# logits / 1e-40 overflow float32 and bfloat16 to inf, and a row of infs is NaN after softmax.
GREEDY_BELOW_TEMPERATURE = 1e-3
# Token ids and counts travel through int64 tensors; 2**31 - 1 keeps them far from overflow and is larger than
# any vocabulary. top_k beyond the vocabulary keeps every token (it is clamped to the vocabulary size).
MAX_INT = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """``low <= value <= high``; ``low_open`` makes the lower bound strict (``low < value``)."""

    low: float
    high: float
    low_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"

    def check(self, field: str, value: float) -> None:
        """ValueError naming ``field`` and its range when ``value`` is outside (NaN is always outside)."""
        if not self.contains(value):
            raise ValueError(f"{field} must be {self.describe()}, got {value!r}")

    def pydantic_bounds(self) -> dict[str, float]:
        """Keyword arguments for ``pydantic.Field``: ``gt``/``ge`` and ``le``."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


SAMPLING_RANGES: MappingProxyType[str, Range] = MappingProxyType({
    "max_tokens": Range(1, MAX_INT),
    "temperature": Range(0.0, 100.0),  # 0 (and anything below GREEDY_BELOW_TEMPERATURE) is greedy
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, MAX_INT),  # 0 or -1 = off; clamped to the vocabulary
    "min_p": Range(0.0, 1.0),
    # A penalty of p divides positive logits by p: 0.01 keeps a 1e4 logit finite in every float type.
    "repetition_penalty": Range(0.01, 10.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    # A job's choice i draws with seed + i, and n <= 64, so seeds stay within torch's 64-bit generator seeds.
    "seed": Range(0, 2**63 - 1),
    "min_tokens": Range(0, MAX_INT),  # and at most max_tokens
    "logprobs": Range(0, 20),
    "stop_token_ids": Range(0, MAX_INT),  # each id; the engine also checks them against its vocabulary
    # Beam search (issue 21): beams a request keeps (1 = off); each beam is one running sequence in the engine, so
    # it is also capped by the engine's max_num_seqs. length_penalty is transformers' exponent on the length.
    "beam_width": Range(1, 64),
    "length_penalty": Range(-10.0, 10.0),
})


def is_greedy(temperature: float) -> bool:
    """Whether a request with this temperature is sampled greedily (argmax)."""
    return temperature < GREEDY_BELOW_TEMPERATURE


# Beam search: transformers' ``early_stopping`` values (True: stop once beam_width hypotheses are finished; False: stop
# when no running beam can beat them by the length heuristic; "never": only the canonical bound stops the search).
EARLY_STOPPING_VALUES: tuple[bool | str, ...] = (True, False, "never")
# Per-token alternatives a beam-search request may ask for (OpenAI's cap for completions logprobs).
MAX_BEAM_LOGPROBS = 5


def beam_search_conflict(fields: dict[str, object]) -> tuple[str, str] | None:
    """``(field, why)`` for the first sampling field a beam-search request (``beam_width > 1``) may not set, else None.

    Beam search is deterministic: it ranks continuations by their log-probabilities, so it takes no temperature,
    no filter of the distribution, no penalty and no stop strings (a hypothesis ends on EOS, a stop token id or the
    length); and at most ``MAX_BEAM_LOGPROBS`` alternatives per token. One rule for the API and the engine.
    """
    if int(fields.get("beam_width", 1) or 1) <= 1:  # type: ignore[call-overload]
        return None
    neutral: dict[str, object] = {"top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                  "frequency_penalty": 0.0}
    if not is_greedy(float(fields.get("temperature", 1.0))):  # type: ignore[arg-type]
        return "temperature", f"must be 0 with beam search (below {GREEDY_BELOW_TEMPERATURE})"
    for name, value in neutral.items():
        if fields.get(name, value) != value:
            return name, f"must be {value} (off) with beam search"
    if fields.get("top_k", 0) not in (0, -1):
        return "top_k", "must be 0 or -1 (off) with beam search"
    if fields.get("stop"):
        return "stop", "is not supported with beam search (use stop_token_ids)"
    if fields.get("grammar") is not None:
        return "grammar", "is not supported with beam search (structured outputs and tools constrain one sequence)"
    logprobs = fields.get("logprobs")
    if logprobs is not None and int(logprobs) > MAX_BEAM_LOGPROBS:  # type: ignore[call-overload]
        return "logprobs", f"must be at most {MAX_BEAM_LOGPROBS} with beam search"
    return None
