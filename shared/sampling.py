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
})


def is_greedy(temperature: float) -> bool:
    """Whether a request with this temperature is sampled greedily (argmax)."""
    return temperature < GREEDY_BELOW_TEMPERATURE
