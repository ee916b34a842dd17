"""A batch line's result, as OpenAI writes it to a batch's output or error file: the response the endpoint would
have given (rendered by the endpoints' own ``chat_response`` / ``completion_response``), or an error."""

from __future__ import annotations

from api.batches.models import LineError, LineResponse, OutputLine, PreparedLine
from api.batches.store import Outcome
from api.errors import error_body
from api.openai_format import chat_response, completion_response
from shared.schemas import JobRecord, JobStatus


def line_id(job_id: str) -> str:
    return f"batch_req_{job_id}"


def job_output(line: PreparedLine, endpoint: str, job: JobRecord, stop: str | None) -> tuple[Outcome, OutputLine]:
    """The result of a line whose job reached a terminal status (any of ``JobStatus``'s terminal ones).

    Succeeded: a 200 response (counted completed). Failed: the 500 the endpoint would have answered. Anything
    else (cancelled, expired, a status added later) ends the line with an error: the batch's stop code when the
    batch was stopping (``batch_cancelled``, ``batch_expired``), otherwise ``job_<status>``.
    """
    job_id = line.submission.id
    if job.status == JobStatus.SUCCEEDED:
        created = int(job.created_at or 0)
        n = line.submission.n
        if endpoint == "/v1/chat/completions":
            body = chat_response(job, completion_id=f"chatcmpl-{job_id}", created=created, n=n,
                                 want_logprobs=line.want_logprobs).model_dump(mode="json")
        else:
            body = completion_response(job, completion_id=f"cmpl-{job_id}", created=created, n=n,
                                       want_logprobs=line.want_logprobs).model_dump(mode="json")
        response = LineResponse(status_code=200, request_id=job_id, body=body)
        return "completed", OutputLine(id=line_id(job_id), custom_id=line.custom_id, response=response)
    if job.status == JobStatus.FAILED:
        body = error_body(500, job.error or "the job failed", type="server_error", code="job_failed")
        response = LineResponse(status_code=500, request_id=job_id, body=body)
        return "failed", OutputLine(id=line_id(job_id), custom_id=line.custom_id, response=response)
    code = stop or f"job_{job.status.value}"
    return "failed", stopped_output(line, code)


def stopped_output(line: PreparedLine, code: str) -> OutputLine:
    """A line ended without a response: the batch was cancelled or expired before it finished."""
    messages = {"batch_cancelled": "the batch was cancelled before this request finished",
                "batch_expired": "the batch's completion window ended before this request finished"}
    error = LineError(code=code, message=messages.get(code, f"the request's job ended {code.removeprefix('job_')}"))
    return OutputLine(id=line_id(line.submission.id), custom_id=line.custom_id, error=error)
