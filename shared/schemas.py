"""Wire models: what travels through Redis between the API, other backends and the workers.

Everything here is JSON (never pickle) and versioned by ``SCHEMA_VERSION``. The field names of
``GenerationParams`` are exactly those of the engine's ``SamplingParams`` so the worker converts with
``SamplingParams(**params.model_dump())``. Nothing here imports torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shared.sampling import GREEDY_BELOW_TEMPERATURE, SAMPLING_RANGES

SCHEMA_VERSION = 1

FinishReason = Literal["stop", "length", "abort"]


def check_unicode(data: Any) -> Any:
    """``data`` unchanged if every string in it (keys too) is valid Unicode; else ValueError.

    JSON allows lone surrogate escapes ("\\ud800") that Python's json module decodes into strings no tokenizer,
    JSON encoder or Redis client can encode; a request carrying one must fail validation (a 400), not later.
    """
    todo = [data]
    while todo:  # a loop, not recursion: nesting depth is the client's choice
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode (no lone surrogates \\ud800-\\udfff)") from None
        elif isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            todo += item
    return data


def _bounds(field: str) -> dict[str, Any]:
    """pydantic bounds of a sampling field, from the one definition in ``shared.sampling``."""
    return {**SAMPLING_RANGES[field].pydantic_bounds(), "allow_inf_nan": False}


class _Wire(BaseModel):
    """Base for wire models: frozen, and unknown fields are an error (a typo must not pass silently)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class GenerationParams(_Wire):
    """Sampling parameters of one job. Ranges come from ``shared.sampling`` and are checked again by the engine."""

    max_tokens: int = Field(16, **_bounds("max_tokens"), description="tokens to generate at most")
    temperature: float = Field(1.0, **_bounds("temperature"),
                               description=f"0 = greedy (so is anything below {GREEDY_BELOW_TEMPERATURE})")
    top_p: float = Field(1.0, **_bounds("top_p"))
    top_k: int = Field(0, **_bounds("top_k"), description="0 or -1 = off; larger than the vocabulary = all tokens")
    min_p: float = Field(0.0, **_bounds("min_p"))
    repetition_penalty: float = Field(1.0, **_bounds("repetition_penalty"))
    presence_penalty: float = Field(0.0, **_bounds("presence_penalty"))
    frequency_penalty: float = Field(0.0, **_bounds("frequency_penalty"))
    seed: int | None = Field(None, **_bounds("seed"))
    stop: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field((), max_length=16)
    stop_token_ids: tuple[Annotated[int, Field(**_bounds("stop_token_ids"))], ...] = Field((), max_length=64)
    ignore_eos: bool = False
    min_tokens: int = Field(0, **_bounds("min_tokens"),
                            description="tokens to generate at least (EOS and stop strings wait)")
    logprobs: int | None = Field(None, **_bounds("logprobs"),
                                 description="None = off; 0 = chosen token; N = top-N too")

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")  # absent when max_tokens itself failed validation
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must be at most max_tokens ({max_tokens})")
        return value


class ChatMessage(_Wire):
    """One chat turn, rendered with the model's chat template."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class JobSubmission(_Wire):
    """A job as pushed into Redis by the API or by any other backend (see docs/protocol.md).

    Exactly one of ``prompt``, ``prompt_token_ids`` or ``messages`` is given. ``n`` choices are generated
    from the same prompt (they share its KV blocks in the engine).
    """

    v: int = SCHEMA_VERSION
    id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    params: GenerationParams = Field(default_factory=GenerationParams)
    n: int = Field(1, ge=1, le=64)
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)
    owner: str | None = Field(None, max_length=128, description="hash of the API key that created the job")
    background: bool = Field(False, description="keep running when the streaming client disconnects")
    created_at: float | None = None
    webhook_url: str | None = Field(None, max_length=2048, description="where the job's terminal event is also "
                                    "sent (the API checks the host against the operator's allow-list)")

    @model_validator(mode="after")
    def _one_prompt(self) -> JobSubmission:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids or messages must be given")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        return self


class JobStatus(str, Enum):
    """The job state machine: queued -> running -> succeeded | failed | cancelled (running -> queued on retry)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class TokenLogprob(_Wire):
    """Log-probability of a chosen token and, when asked for, the top alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = Field(default_factory=list)
    # The token's raw bytes (its text alone is U+FFFD when it holds part of a character), and each top entry's.
    bytes: list[int] | None = None
    top_bytes: list[list[int]] | None = None


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class SpecDecodeStats(_Wire):
    """Speculative decoding outcome of one choice."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Choice(_Wire):
    """One of a job's ``n`` outputs."""

    index: int
    text: str
    finish_reason: FinishReason | None = None
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    spec_decode: SpecDecodeStats | None = None


class JobResult(_Wire):
    """What a worker writes atomically with the final status."""

    choices: list[Choice]
    usage: Usage


class JobRecord(_Wire):
    """A job as clients see it (``GET /v1/jobs/{id}``). ``text``/``finish_reason`` mirror choice 0."""

    id: str
    model: str
    status: JobStatus
    priority: int = 0
    attempts: int = 0
    text: str | None = None
    finish_reason: FinishReason | None = None
    choices: list[Choice] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    error: str | None = None
    worker_id: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class TokenEvent(_Wire):
    """New text of one choice, produced in one engine step. ``seq`` numbers a job's events 1, 2, 3..."""

    type: Literal["token"] = "token"
    seq: int
    index: int = 0
    text: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class RestartEvent(_Wire):
    """The job was restarted (worker died or Redis lost it): discard all text received so far."""

    type: Literal["restart"] = "restart"
    seq: int
    attempt: int


class DoneEvent(_Wire):
    """The job reached a terminal state; ``job`` is its final record."""

    type: Literal["done"] = "done"
    seq: int
    job: JobRecord


class ErrorEvent(_Wire):
    """The stream cannot continue (e.g. the job expired)."""

    type: Literal["error"] = "error"
    seq: int
    message: str


StreamEvent = Annotated[TokenEvent | RestartEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]


class WorkerInfo(_Wire):
    """A live worker, as registered in Redis by its heartbeat."""

    id: str
    model: str
    max_num_seqs: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    heartbeat_at: float
    started_at: float


class ModelCard(_Wire):
    """What a worker publishes about its model so the API can validate and template without loading it."""

    name: str
    max_model_len: int
    eos_token_ids: list[int]
    chat_template: str | None = None
    vocab_size: int
    tokenizer_json: str | None = Field(
        None, description="the fast tokenizer's JSON (tokenizer.backend_tokenizer.to_str()); lets the API count tokens"
    )
    special_tokens: dict[str, str] = Field(
        default_factory=dict, description="tokenizer.special_tokens_map (bos_token, eos_token, ...) for chat templates"
    )
