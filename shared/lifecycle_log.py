"""Job lifecycle log lines: one JSON line per transition, findable by ``job_id``, ``model``, ``worker_id``, ``event``.

Callers keep ``%``-style messages and pass ``extra=job_fields(...)``; ``shared.logging_setup.JsonFormatter``
turns the extras into top-level fields. Prompt and output text go in only through ``text_fields`` and only when
``settings.log_prompts`` is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LifecycleEvent = Literal[
    "submitted",  # API: enqueued
    "claimed",  # worker: claimed and added to the engine
    "first_token",  # worker: first token published
    "finished",  # worker: completed (succeeded)
    "cancelled",  # worker or reaper: ended on a client's cancel
    "failed",  # worker: failed for good (the engine refused the job)
    "released",  # worker: handed back to the queue (drain, engine failure)
    "requeued",  # reaper: lease expired, back in the queue (a restart for its readers)
    "dead_lettered",  # reaper or release: out of attempts, failed and dead-lettered
    "lease_lost",  # worker: another holder took over; this worker dropped it
    "expired",  # worker: its deadline passed (not started in time: by a claim; running: stopped, partial text)
]


@dataclass(frozen=True)
class Recovery:
    """What a reap or a release left a running job as: its lifecycle event when the reaper (``by_reaper``) or
    its own worker (``by_worker``) did it, and its ``tokenspool_jobs_total`` event (docs/operations.md)."""

    by_reaper: LifecycleEvent
    by_worker: LifecycleEvent
    jobs_total: str


# The one status -> event map of recovered jobs (reap.lua and release.lua return the status).
RECOVERIES: dict[str, Recovery] = {
    "queued": Recovery("requeued", "released", "retried"),
    "failed": Recovery("dead_lettered", "dead_lettered", "dead_lettered"),
    "cancelled": Recovery("cancelled", "cancelled", "cancelled"),
}


def job_fields(event: LifecycleEvent, job_id: str, model: str, worker_id: str | None = None,
               **fields: object) -> dict[str, object]:
    """``extra=`` for one lifecycle line (``fields``: anything else worth searching on, e.g. ``attempt``)."""
    return {"event": event, "job_id": job_id, "model": model, "worker_id": worker_id, **fields}


def text_fields(log_prompts: bool, **texts: object) -> dict[str, object]:
    """``texts`` (prompt, output, ...) when ``log_prompts`` is on, else nothing: text is never logged by default."""
    return dict(texts) if log_prompts else {}
