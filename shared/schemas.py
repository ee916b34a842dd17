"""Wire models: what travels through Redis between the API, other backends and the workers.

Everything here is JSON (never pickle) and versioned by ``SCHEMA_VERSION``. The field names of
``GenerationParams`` are exactly those of the engine's ``SamplingParams`` so the worker converts with
``SamplingParams(**params.model_dump())``. Nothing here imports torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from shared.grammar import MAX_GRAMMAR_CHARS, GrammarKind, check_grammar
from shared.sampling import GREEDY_BELOW_TEMPERATURE, MAX_INT, SAMPLING_RANGES, beam_search_conflict

SCHEMA_VERSION = 1
MAX_TIMEOUT_S = 30 * 86_400.0  # the longest queue_timeout_s / timeout_s a job may carry

FinishReason = Literal["stop", "length", "abort", "timeout"]  # timeout: past the job's timeout_s


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


class Grammar(_Wire):
    """A grammar the output must match (constrained decoding; ``shared.grammar``). Checked with llguidance here, so
    a job with a grammar that does not compile is refused at submission."""

    kind: GrammarKind = Field(description="json_schema | json_object | regex | lark")
    value: str = Field("", max_length=MAX_GRAMMAR_CHARS,
                       description="the JSON schema as JSON text, the regex or the Lark grammar; empty for json_object")

    @model_validator(mode="after")
    def _compiles(self) -> Grammar:
        check_grammar(self.kind, self.value)
        return self


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
    beam_width: int = Field(1, **_bounds("beam_width"),
                            description="beam search with this many beams when > 1 (temperature 0, no filters)")
    length_penalty: float = Field(1.0, **_bounds("length_penalty"),
                                  description="beam score = sum of log-probs / length ** length_penalty")
    early_stopping: bool | Literal["never"] = Field(False, description='transformers\' meaning: true, false, "never"')

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping_value(cls, value: Any) -> Any:
        if value is True or value is False or value == "never":
            return value
        raise ValueError('must be true, false or "never"')

    @model_validator(mode="before")
    @classmethod
    def _beam_search_is_greedy(cls, data: Any) -> Any:
        """Beam search is deterministic: an unset temperature is 0 there (a set one above 0 is refused)."""
        if isinstance(data, dict) and "temperature" not in data and isinstance(data.get("beam_width"), int) \
                and data["beam_width"] > 1:
            return {**data, "temperature": 0.0}
        return data

    @model_validator(mode="after")
    def _beam_search_alone(self) -> GenerationParams:
        conflict = beam_search_conflict(dict(self))
        if conflict is not None:
            name, why = conflict
            raise PydanticCustomError("beam_search", f"{name} {why}", {"param": name, "code": "invalid_value"})
        return self
    grammar: Grammar | None = Field(None, description="constrain the output to a JSON schema, regex or grammar")

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")  # absent when max_tokens itself failed validation
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must be at most max_tokens ({max_tokens})")
        return value


class FunctionCall(_Wire):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Wire):
    """A function call an assistant turn made (OpenAI's shape)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Wire):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ToolSpec(_Wire):
    """A tool the model may call (OpenAI's shape); rendered into the prompt (``shared.tool_prompt``)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatMessage(_Wire):
    """One chat turn, rendered with the model's chat template (``shared.tool_prompt`` for tool calls)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    tool_calls: list[ToolCall] | None = Field(None, description="assistant turns: the calls it made")
    tool_call_id: str | None = Field(None, description="tool turns: the call this result answers")
    name: str | None = None


class JobSubmission(_Wire):
    """A job as pushed into Redis by the API or by any other backend (see docs/protocol.md).

    Exactly one of ``prompt``, ``prompt_token_ids`` or ``messages`` is given. ``n`` choices are generated
    from the same prompt (they share its KV blocks in the engine).
    """

    v: int = SCHEMA_VERSION
    id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT)]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolSpec] | None = Field(None, max_length=128, description="with messages: tools for the template")
    params: GenerationParams = Field(default_factory=GenerationParams)
    n: int = Field(1, ge=1, le=64)
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)
    owner: str | None = Field(None, max_length=128, description="hash of the API key that created the job")
    background: bool = Field(False, description="keep running when the streaming client disconnects")
    created_at: float | None = None
    queue_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                          description="must start within this many seconds, else it ends expired")
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                    description="must end within this many seconds of submission: expired if not "
                                    "started by then; a running job stops with finish reason timeout")
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
        if self.n > self.params.beam_width > 1:
            raise PydanticCustomError("beam_search", f"n (returned beams) must be at most beam_width "
                                      f"({self.params.beam_width}) with beam search",
                                      {"param": "n", "code": "invalid_value"})
        return self


class JobStatus(str, Enum):
    """The job state machine: queued -> running -> succeeded | failed | cancelled | expired (running -> queued on
    retry). ``expired``: the job's deadline passed, before it started (no result, never on a worker) or while it
    ran (its partial text, finish reason ``timeout``)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


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
    beam_score: float | None = Field(None, description="beam search: sum of log-probs / length ** length_penalty")


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
    # Set on the first event of each attempt only (absent from the JSON otherwise): the prompt's length in tokens
    # as the worker encoded it, the same count as the result's usage.prompt_tokens. Streams that report usage as
    # they go (OpenAI's stream_options.continuous_usage_stats) read it from here.
    num_prompt_tokens: int | None = Field(None, ge=0, exclude_if=lambda v: v is None)


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


class WorkerTotals(_Wire):
    """A worker's cumulative counts since it started (its Prometheus counters), sent with each heartbeat so the
    API can chart throughput and latency without scraping workers: rates are differences between heartbeats."""

    num_generated_tokens: int = 0
    num_first_tokens: int = 0
    ttft_sum_s: float = 0.0
    num_finished_jobs: int = 0
    e2e_sum_s: float = 0.0


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
    totals: WorkerTotals | None = None


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
