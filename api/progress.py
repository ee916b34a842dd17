"""A running job as a poll shows it: the text so far and the prompt tokens, which the record gets only at the end.

The record in Redis holds the result only from the final transition on; until then the job's replay log is
where its text is (docs/protocol.md, "Events"). The log starts at the latest restart event (the scripts trim
it there), so folding its token events gives exactly the current attempt's text. Reading it costs one XRANGE
of at most ``max_tokens`` entries per choice, paid by the poll that asks, never by the worker.
"""

from __future__ import annotations

from typing import Any

from api.errors import APIError
from api.submission import count_prompt_tokens
from api.tokenization import ModelCatalog
from shared.queue import JobQueue
from shared.schemas import Choice, JobRecord, JobSubmission, Usage


def fold_choices(entries: list[dict[str, Any]], num_choices: int) -> list[Choice]:
    """Each choice's text and token ids so far from the job's log entries; a restart event starts over."""
    texts: list[list[str]] = [[] for _ in range(num_choices)]
    token_ids: list[list[int]] = [[] for _ in range(num_choices)]
    for entry in entries:
        if entry.get("type") == "restart":
            texts = [[] for _ in range(num_choices)]
            token_ids = [[] for _ in range(num_choices)]
        elif entry.get("type") == "token" and 0 <= entry.get("index", 0) < num_choices:
            texts[entry.get("index", 0)].append(entry["text"])
            token_ids[entry.get("index", 0)] += entry.get("token_ids", [])
    return [Choice(index=i, text="".join(texts[i]), token_ids=token_ids[i]) for i in range(num_choices)]


async def prompt_tokens(catalog: ModelCatalog, submission: JobSubmission) -> int:
    """The job's prompt tokens counted with the model card's tokenizer, as at submission; 0 while unknown
    (no card published, or a job pushed into Redis by another backend that the card cannot render)."""
    model = await catalog.get(submission.model)
    if model is None:
        return 0
    try:
        count = await count_prompt_tokens(model, prompt=submission.prompt,
                                          prompt_token_ids=submission.prompt_token_ids,
                                          messages=submission.messages)
    except APIError:  # e.g. a chat job for a model without a template: the worker will fail it, not the poll
        return 0
    return count or 0


async def with_progress(queue: JobQueue, catalog: ModelCatalog, submission: JobSubmission,
                        record: JobRecord) -> JobRecord:
    """``record`` (a running job) with its text, choices and usage so far."""
    choices = fold_choices(await queue.replay(record.id, 0), submission.n)
    usage = Usage(prompt_tokens=await prompt_tokens(catalog, submission),
                  completion_tokens=sum(len(c.token_ids) for c in choices))
    return record.model_copy(update={"text": choices[0].text, "choices": choices, "usage": usage})
