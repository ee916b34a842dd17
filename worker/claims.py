"""Claiming: take as many jobs as the engine has seats for, and turn each into the engine's requests.

A job the engine refuses (bad params, a prompt too long, no chat template) fails at once with ``invalid job:``.
An isolated job (crash isolation, docs/protocol.md) is claimed alone, and nothing is claimed beside it.
"""

from __future__ import annotations

import logging
import time

from shared.lifecycle_log import text_fields
from shared.queue import ClaimedJob
from shared.schemas import JobSubmission
from worker.context import WorkerContext
from worker.engine import SamplingParams
from worker.jobs import ActiveJob, prompt_token_ids, request_id
from worker.port import EnginePort

log = logging.getLogger(__name__)

CLAIMS_PER_STEP = 16  # jobs claimed between two engine steps at most, so a deep queue cannot stall decoding


class Claimer:
    """Claims jobs for one worker and adds them to its engine (on the engine thread)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx

    async def claim(self, active: dict[str, ActiveJob]) -> tuple[list[ActiveJob], bool]:
        """New jobs, already in the engine, and whether the queue may hold more (all seats offered were taken)."""
        if any(job.claim.alone for job in active.values()):
            return [], False  # an isolated job runs with nothing beside it
        wanted = min(CLAIMS_PER_STEP, await self._ctx.engine_thread.call(self._ctx.engine.free_seats))
        if not wanted:
            return [], True
        claims, num_expired = await self._ctx.redis(self._ctx.queue.claim_and_expire, self._ctx.model,
                                                    self._ctx.worker_id, wanted, not active)
        for _ in range(num_expired):
            self._ctx.metrics.on_job_event("expired")
        started = [job for claim in claims if (job := await self._start(claim, active)) is not None]
        return started, len(claims) == wanted

    async def _start(self, claim: ClaimedJob, active: dict[str, ActiveJob]) -> ActiveJob | None:
        sub = claim.submission
        stale = active.pop(sub.id, None)
        if stale is not None:  # claimed again before we noticed its lease was lost: the old attempt is dead
            await self._ctx.engine_thread.call(abort_all, self._ctx.engine, stale.unfinished_request_ids())
        try:
            num_prompt_tokens = await self._ctx.engine_thread.call(self._add_requests, sub)
        except Exception as exc:  # bad params, prompt too long, template error: this job's fault, not ours
            log.warning("job %s rejected: %s", sub.id, exc,
                        extra=self._ctx.fields("failed", sub.id, attempt=claim.attempt))
            if await self._ctx.redis(self._ctx.queue.fail, sub.id, claim.fence, f"invalid job: {exc}"):
                self._ctx.metrics.on_job_event("failed")
            return None
        self._ctx.metrics.on_claimed(sub.created_at, time.time(), num_prompt_tokens)
        log.info("job %s claimed (attempt %d)", sub.id, claim.attempt,
                 extra=self._ctx.fields("claimed", sub.id, attempt=claim.attempt, alone=claim.alone,
                                    priority=sub.priority, n=sub.n, num_prompt_tokens=num_prompt_tokens,
                                    **text_fields(self._ctx.settings.log_prompts, prompt=sub.prompt,
                                                  messages=[m.model_dump() for m in sub.messages or []] or None)))
        return ActiveJob.start(claim)

    def _add_requests(self, job: JobSubmission) -> int:
        """Engine thread: the job's n requests, all or none; returns the prompt's length in tokens."""
        if job.model != self._ctx.model:
            raise ValueError(f"model: this worker serves {self._ctx.model!r}, not {job.model!r}")
        prompt = prompt_token_ids(job, self._ctx.engine.tokenizer)
        params = SamplingParams(**job.params.model_dump())
        # One group: the prompt is prefilled once and its KV blocks shared by the n choices; choice i of a seeded
        # job draws with seed + i (Engine.add_request_group).
        self._ctx.engine.add_request_group([request_id(job.id, i) for i in range(job.n)], prompt, params,
                                       priority=job.priority)
        return len(prompt)


def abort_all(engine: EnginePort, request_ids: list[str]) -> None:
    """Engine thread: abort requests (unknown or finished ones are ignored)."""
    for rid in request_ids:
        engine.abort(rid)
