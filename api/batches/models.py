"""The Batch API's OpenAI shapes: the ``batch`` object, its request counts and errors, input and output lines."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas import JobSubmission

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
# Statuses a batch never leaves.
TERMINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    """OpenAI's ``batch`` object (``GET /v1/batches/{id}``)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchCreate(BaseModel):
    """``POST /v1/batches``. ``webhook_url`` (tokenspool's): where this batch's event also goes, when its host is
    in the operator's allow-list."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None
    webhook_url: str | None = Field(None, max_length=2048)


class InputLine(BaseModel):
    """One line of a batch input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class PreparedLine(BaseModel):
    """A validated line as the batch keeps it: what to submit and how to render its result."""

    model_config = ConfigDict(frozen=True)

    custom_id: str
    want_logprobs: bool
    submission: JobSubmission


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class OutputLine(BaseModel):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: LineResponse | None = None
    error: LineError | None = None
