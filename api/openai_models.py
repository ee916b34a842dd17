"""Request and response bodies of the OpenAI-compatible endpoints (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``).

Requests ignore unknown fields, as OpenAI clients send fields we have no use for (``user``, ``store``...).
Sampling values are not range-checked here: they are copied into ``GenerationParams``, the one definition of
the allowed ranges, whose validation errors become 400s naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.schemas import MAX_TIMEOUT_S, check_unicode


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_unicode(data)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="a last chunk with the usage, and no choices")
    continuous_usage_stats: bool = Field(False, description="vLLM's extension (needs include_usage): every chunk "
                                         "carries the usage so far")
    include_obfuscation: bool | None = Field(None, description="false only: tokenspool never pads its stream "
                                             "events with obfuscation (true is a 400)")


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions, with tokenspool's extras (vLLM's names)."""

    model: str | None = Field(None, description="default: the served model")
    n: int = Field(1, ge=1, description="choices to generate; capped by the server's max_n")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # tokenspool / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    priority: int = Field(0, description="higher runs first")
    background: bool = Field(False, description="keep generating when the client disconnects")
    # vLLM's beam-search extras: n is the beam width and the n beams come back as the choices, best first.
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | str | None = None  # true, false or "never" (checked by GenerationParams)
    # structured outputs (vLLM's names; api/structured_output.py): at most one of these or response_format
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_extras(self) -> dict[str, Any]:
        """The structured-output extras as given (None when absent)."""
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar,
                "structured_outputs": self.structured_outputs}
    queue_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S,
                                          description="must start within this many seconds, else 504 job_expired")
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description="must end within this many seconds; "
                                    "a running job stops with finish_reason timeout")


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. One prompt per request: text or token ids (a one-element list is accepted)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, description="top alternatives per token (0 = chosen token only)")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns (content may then be null)
    tool_call_id: str | None = None  # tool turns


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI fields tokenspool does not honour: declared so that sending one is a 400 naming it, not ignored.
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: Any = None
    prediction: Any = None
    web_search_options: Any = None


# --- responses ----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    """A streamed tool call: tokenspool sends each call whole, in one delta."""

    index: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tokenspool"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]
