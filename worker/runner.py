"""The Redis <-> engine bridge: claim jobs while the engine has room, feed its step loop, publish every step's
deltas, write results, renew leases, obey cancellations, and drain on shutdown.

Every engine call runs on the thread that built the engine (``EngineThread``); the asyncio loop stays free for
lease renewal and cancellation while a step computes. A step's events are published while the next step
computes (``_deliver``), so the engine does not wait on Redis between steps, except after a step that produced a
job's first token, whose delivery comes first. The pure parts (job -> engine requests, step outputs -> events
and results) live in ``worker.jobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import OutOfMemoryError
from tenacity import AsyncRetrying, before_sleep_log, retry_if_exception_type, stop_after_delay, wait_random_exponential

from shared.config import Settings
from shared.lifecycle_log import LifecycleEvent, job_fields, text_fields
from shared.queue import TRANSIENT_ERRORS, ClaimedJob, JobQueue
from shared.schemas import JobSubmission, TokenEvent, TokenLogprob, WorkerInfo
from worker.engine import Engine, SamplingParams, StepOutput
from worker.engine_thread import EngineThread
from worker.jobs import ActiveJob, model_card, prompt_token_ids, request_id, split_request_id, to_token_logprobs
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
CLAIMS_PER_STEP = 16  # jobs claimed between two engine steps at most, so a deep queue cannot stall decoding
REDIS_RETRY_S = 300.0  # a Redis outage longer than this ends the worker (exit 1) for its supervisor to restart
# What the worker waits out, retrying: an outage, and a full Redis (maxmemory with noeviction refuses writes until
# results expire or memory is added). Exiting instead would restart the worker into the same wall and lose the
# work of every running job.
RETRYABLE_ERRORS = (*TRANSIENT_ERRORS, OutOfMemoryError)
TASK_STOP_S = 2.0  # how long shutdown waits for the heartbeat and cancellation tasks to unwind
# The lifecycle event of a job this worker released, by the status the release left it in.
RELEASE_EVENTS: dict[str, LifecycleEvent] = {"queued": "released", "failed": "dead_lettered", "cancelled": "cancelled"}


class Runner:
    """Serves one model from one engine until ``request_stop``; ``run`` returns the process exit code."""

    def __init__(self, engine: Engine, engine_thread: EngineThread, queue: JobQueue, settings: Settings,
                 worker_id: str, redis_retry_s: float = REDIS_RETRY_S, metrics: WorkerMetrics | None = None) -> None:
        self._engine = engine
        self._engine_thread = engine_thread
        self._queue = queue
        self._settings = settings
        self._worker_id = worker_id
        self._model = settings.served_model_name
        self._card = model_card(self._model, engine)
        self._metrics = metrics or WorkerMetrics(self._model)
        self._started_at = time.time()
        self._redis_retry_s = redis_retry_s
        self._active: dict[str, ActiveJob] = {}
        self._lost: set[tuple[str, int]] = set()  # (job id, fence) of attempts whose lease was lost
        self._cancelled: set[str] = set()
        self._stop = asyncio.Event()
        self._nudge = asyncio.Event()  # set when a job may be waiting in the queue, or a stop was requested
        self._next_poll_at = 0.0  # time.monotonic() when the worker claims next even without a nudge
        self._delivery: asyncio.Task[None] | None = None  # the last step's publish + completions, in flight

    def request_stop(self) -> None:
        """SIGTERM: stop claiming, finish running jobs within ``drain_timeout_s``, release the rest."""
        if not self._stop.is_set():
            log.info("worker %s draining (%d jobs running)", self._worker_id, len(self._active))
        self._stop.set()
        self._nudge.set()

    async def run(self) -> int:
        """The main loop. Background tasks renew leases and listen for cancellations and wake-ups meanwhile."""
        await self._redis(self._queue.register_worker, await self._info(), self._card)
        tasks = [asyncio.create_task(self._lease_loop(), name="leases"),
                 asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                 asyncio.create_task(self._cancel_loop(), name="cancellations"),
                 asyncio.create_task(self._wake_loop(), name="wakeups")]
        code = 0
        try:
            code = await self._serve()
        finally:
            await self._shutdown(tasks)
        return code

    async def _serve(self) -> int:
        drain_deadline: float | None = None
        while True:
            if self._stop.is_set():
                drain_deadline = drain_deadline or time.monotonic() + self._settings.drain_timeout_s
                if not self._active or time.monotonic() >= drain_deadline:
                    return 0
            await self._apply_control()
            if not self._stop.is_set():
                await self._fill()
            if self._active:
                if not await self._step():
                    return 1
            else:
                await self._idle()

    async def _idle(self) -> None:
        """Nothing to run: wait for a wake message (a job entered the queue), a stop, or the next poll."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._nudge.wait(), max(0.0, self._next_poll_at - time.monotonic()))

    # --- claiming -------------------------------------------------------------------------------------------

    async def _fill(self) -> None:
        """Claim as many jobs as the engine has seats for (one round trip), when a job may be waiting: after a
        wake message, or at the next poll. A queue found empty is not asked again until then, so a busy worker
        spends no round trip per step on it."""
        if self._stop.is_set() or (not self._nudge.is_set() and time.monotonic() < self._next_poll_at):
            return  # a draining worker takes nothing new
        if any(job.claim.alone for job in self._active.values()):
            return  # an isolated job runs with nothing beside it (crash isolation)
        self._nudge.clear()  # before claiming: a job queued from now on sets it again
        self._next_poll_at = time.monotonic() + self._settings.claim_poll_s
        wanted = min(CLAIMS_PER_STEP, await self._on_engine(self._engine.free_seats))
        jobs = (await self._redis(self._queue.claim, self._model, self._worker_id, wanted, not self._active)
                if wanted else [])
        for job in jobs:
            await self._start(job)
        if not wanted or len(jobs) == wanted:
            self._nudge.set()  # the queue may hold more: look again next step (once a seat is free)

    async def _start(self, job: ClaimedJob) -> None:
        """Add the job's requests to the engine; a job the engine refuses fails with the reason."""
        sub = job.submission
        stale = self._active.pop(sub.id, None)
        if stale is not None:  # claimed again before we noticed its lease was lost: the old attempt is dead
            await self._on_engine(self._abort_all, stale.unfinished_request_ids())
        try:
            num_prompt_tokens = await self._on_engine(self._add_requests, sub)
        except Exception as exc:  # bad params, prompt too long, template error: this job's fault, not ours
            log.warning("job %s rejected: %s", sub.id, exc, extra=self._fields("failed", sub.id, attempt=job.attempt))
            if await self._redis(self._queue.fail, sub.id, job.fence, f"invalid job: {exc}"):
                self._metrics.on_job_event("failed")
            return
        self._active[sub.id] = ActiveJob.start(job)
        self._metrics.on_claimed(sub.created_at, time.time(), num_prompt_tokens)
        log.info("job %s claimed (attempt %d)", sub.id, job.attempt,
                 extra=self._fields("claimed", sub.id, attempt=job.attempt, priority=sub.priority, n=sub.n,
                                    num_prompt_tokens=num_prompt_tokens,
                                    **text_fields(self._settings.log_prompts, prompt=sub.prompt,
                                                  messages=[m.model_dump() for m in sub.messages or []] or None)))

    def _add_requests(self, job: JobSubmission) -> int:
        """Engine thread: the job's n requests, all or none; returns the prompt's length in tokens."""
        if job.model != self._model:
            raise ValueError(f"model: this worker serves {self._model!r}, not {job.model!r}")
        prompt = prompt_token_ids(job, self._engine.tokenizer)
        params = SamplingParams(**job.params.model_dump())
        # One group: the prompt is prefilled once and its KV blocks shared by the n choices; choice i of a seeded
        # job draws with seed + i (Engine.add_request_group).
        self._engine.add_request_group([request_id(job.id, i) for i in range(job.n)], prompt, params,
                                       priority=job.priority)
        return len(prompt)

    # --- stepping -------------------------------------------------------------------------------------------

    async def _step(self) -> bool:
        """One engine step. Its events go out in one pipeline behind the next step (see ``_deliver``), then
        the jobs it finished are completed. False when the engine failed (its jobs are released, charged, and
        the worker exits)."""
        try:
            outputs = await self._on_engine(self._step_engine)
        except Exception:
            log.exception("engine step failed; releasing %d jobs", len(self._active))
            await self._settle()
            for job in list(self._active.values()):
                await self._release(job, charge_attempt=True)
            self._active.clear()
            return False
        published, finished = self._apply(outputs)
        for job in finished:
            if job.error is not None:  # its other choices may still be in the engine
                await self._on_engine(self._abort_all, job.unfinished_request_ids())
        await self._settle()  # the previous step's events go out first: a job's events stay in seq order
        delivery = self._deliver(published, finished)
        if any(not job.first_token_published for job, _ in published):
            await delivery  # a first token: TTFT is worth more than one step's publish time
        else:
            self._delivery = asyncio.create_task(delivery, name="delivery")
        return True

    def _apply(self, outputs: list[tuple[StepOutput, list[TokenLogprob] | None]]
               ) -> tuple[list[tuple[ActiveJob, list[TokenEvent]]], list[ActiveJob]]:
        """Fold a step's outputs into the jobs: the events to publish per job, and the jobs now done (no
        longer active: the engine is finished with them; their delivery completes them)."""
        events: dict[str, list[TokenEvent]] = {}
        for out, logprobs in outputs:
            job_id, index = split_request_id(out.request_id)
            job = self._active.get(job_id)
            if job is None:
                continue
            event = job.apply(out, index, logprobs)
            if event is not None:
                events.setdefault(job_id, []).append(event)
        published = [(self._active[job_id], evs) for job_id, evs in events.items()]
        finished = [self._active.pop(job.job_id) for job in list(self._active.values()) if job.done]
        return published, finished

    async def _deliver(self, published: list[tuple[ActiveJob, list[TokenEvent]]], finished: list[ActiveJob]) -> None:
        """Publish one step's events (one pipeline), then complete the jobs it finished. A job whose events were
        refused lost its lease: an unfinished one is dropped before the next step, a finished one not completed."""
        refused: set[str] = set()
        if published:
            accepted = await self._redis(self._queue.publish_many,
                                         [(job.job_id, job.claim.fence, evs) for job, evs in published])
            refused = {job.job_id for (job, _), ok in zip(published, accepted, strict=True) if not ok}
            self._first_tokens([job for job, _ in published if job.job_id not in refused])
        done_ids = {job.job_id for job in finished}
        self._lost.update((job.job_id, job.claim.fence) for job, _ in published
                          if job.job_id in refused and job.job_id not in done_ids)
        for job in finished:
            if job.job_id in refused:
                log.warning("job %s dropped: lease lost", job.job_id, extra=self._fields("lease_lost", job.job_id))
            else:
                await self._finish(job)

    async def _settle(self) -> None:
        """Wait for the delivery still in flight, if any (raising what it raised)."""
        delivery, self._delivery = self._delivery, None
        if delivery is not None:
            await delivery

    def _step_engine(self) -> list[tuple[StepOutput, list[TokenLogprob] | None]]:
        """Engine thread: a step, with logprob token texts decoded here (the tokenizer lives on this thread)."""
        started = time.perf_counter()
        outputs = self._engine.step()
        duration_s = time.perf_counter() - started
        stats = self._engine.stats()
        # Sequences computed in the step: those still running after it plus those it finished.
        batch_size = stats.num_running + sum(out.finished for out in outputs)
        self._metrics.on_step(duration_s, batch_size, sum(len(out.new_token_ids) for out in outputs), stats)
        return [(out, to_token_logprobs(out.logprobs, self._engine.tokenizer) if out.logprobs else None)
                for out in outputs]

    def _first_tokens(self, jobs: list[ActiveJob]) -> None:
        """Jobs whose events were just published: the first time a job's token went out is its TTFT."""
        now = time.time()
        for job in jobs:
            if not job.first_token_published and any(c.token_ids for c in job.choices):
                job.first_token_published = True
                self._metrics.on_first_token(job.claim.submission.created_at, now)
                log.info("job %s first token", job.job_id, extra=self._fields("first_token", job.job_id))

    async def _finish(self, job: ActiveJob) -> None:
        """Write the result of a job that left ``_active`` (done, or cancelled), with its metrics and log line."""
        if job.error is not None:
            if await self._redis(self._queue.fail, job.job_id, job.claim.fence, job.error):
                self._metrics.on_job_event("failed")
                log.warning("job %s failed: %s", job.job_id, job.error, extra=self._fields("failed", job.job_id))
            return
        result = job.result()
        ok = await self._redis(self._queue.complete, job.job_id, job.claim.fence, result)
        if not ok:
            log.warning("job %s result rejected: lease lost (stale fence)", job.job_id,
                        extra=self._fields("lease_lost", job.job_id))
            return
        cancelled = any(c.finish_reason == "abort" for c in result.choices)
        self._metrics.on_job_finished("cancelled" if cancelled else "completed", job.claim.submission.created_at,
                                      time.time())
        for choice in job.choices:
            self._metrics.on_sequence_finished(len(choice.token_ids), choice.first_token_at, choice.last_token_at)
        log.info("job %s %s", job.job_id, "cancelled" if cancelled else "finished",
                 extra=self._fields("cancelled" if cancelled else "finished", job.job_id,
                                    finish_reasons=[c.finish_reason for c in result.choices],
                                    prompt_tokens=result.usage.prompt_tokens,
                                    completion_tokens=result.usage.completion_tokens,
                                    **text_fields(self._settings.log_prompts,
                                                  output=[c.text for c in result.choices])))

    # --- control: lost leases, cancellations, heartbeat -------------------------------------------------------

    async def _apply_control(self) -> None:
        """Abort jobs whose lease was lost (dropped) and jobs cancelled by a client (completed as cancelled).

        A lost lease is matched by fence, not only by job id: the queue may have handed the job back to this
        very worker (a new attempt, a new fence) before the old attempt's refusal arrived.
        """
        lost = [job_id for job_id, fence in self._lost
                if (job := self._active.get(job_id)) is not None and job.claim.fence == fence]
        self._lost = set()
        for job_id in lost:
            job = self._active.pop(job_id)
            await self._on_engine(self._abort_all, job.unfinished_request_ids())
            log.warning("job %s dropped: lease lost", job_id, extra=self._fields("lease_lost", job_id))
        cancelled, self._cancelled = self._cancelled & self._active.keys(), set()
        if cancelled:
            await self._settle()  # its last events go out before its result
        for job_id in cancelled:
            job = self._active.pop(job_id)
            await self._on_engine(self._abort_all, job.unfinished_request_ids())
            job.abort()
            await self._finish(job)

    def _abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._engine.abort(rid)

    async def _lease_loop(self) -> None:
        """Renew the leases of running jobs every heartbeat. Never waits for the engine: a step longer than the
        lease (a long prefill on a busy machine) must not let a healthy worker's jobs be taken away."""
        while True:
            await asyncio.sleep(self._settings.heartbeat_interval_s)
            try:
                fences = {job_id: job.claim.fence for job_id, job in self._active.items()}
                lost_ids = await self._redis(self._queue.renew, self._worker_id, fences)
                self._lost.update((job_id, fences[job_id]) for job_id in lost_ids)
            except Exception:
                log.exception("lease renewal of worker %s failed", self._worker_id)

    async def _heartbeat_loop(self) -> None:
        """Refresh the worker's registration (with the engine's stats) and reap expired leases, every heartbeat."""
        while True:
            await asyncio.sleep(self._settings.heartbeat_interval_s)
            try:
                await self._redis(self._queue.register_worker, await self._info(), self._card)
                for recovered in await self._redis(self._queue.reap):
                    self._metrics.on_requeue_status(recovered.status)
            except Exception:
                log.exception("heartbeat of worker %s failed", self._worker_id)

    async def _cancel_loop(self) -> None:
        async for job_id in self._queue.cancellations(self._worker_id):
            self._cancelled.add(job_id)

    async def _wake_loop(self) -> None:
        async for _ in self._queue.wakeups(self._model):
            self._nudge.set()

    async def _info(self) -> WorkerInfo:
        stats = await self._on_engine(self._engine.stats)
        self._metrics.on_engine_stats(stats)
        return WorkerInfo(id=self._worker_id, model=self._model, max_num_seqs=self._settings.max_num_seqs,
                          num_running=stats.num_running, num_waiting=stats.num_waiting,
                          kv_cache_usage=stats.kv_cache_usage, heartbeat_at=time.time(), started_at=self._started_at)

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        """Release what did not finish (without charging the attempt), stop the helpers, leave the registry.

        Redis gets one lease TTL to answer: after that the leases expire and reapers recover the jobs anyway
        (charging the attempt), so waiting longer would only delay the exit.
        """
        for task in tasks:
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=TASK_STOP_S)
        if stuck:
            log.warning("helper tasks %s did not stop within %s s; leaving them", sorted(t.get_name() for t in stuck),
                        TASK_STOP_S, extra={"stacks": [repr(t.get_stack()) for t in stuck]})
        patience = self._settings.lease_ttl_s
        try:
            await self._settle()  # the last step's events and results
            for job in list(self._active.values()):
                await self._on_engine(self._abort_all, job.unfinished_request_ids())
                await self._release(job, charge_attempt=False, give_up_s=patience)
            await self._redis(self._queue.deregister_worker, self._worker_id, give_up_s=patience)
        except RETRYABLE_ERRORS as exc:
            log.error("could not release jobs or deregister (%s); their leases will expire", exc)
        finally:
            self._active.clear()
            self._engine_thread.shutdown()

    async def _release(self, job: ActiveJob, charge_attempt: bool, give_up_s: float | None = None) -> None:
        """Hand the job back to the queue (drain, engine failure), counted and logged by where it went."""
        status = await self._redis(self._queue.release_job, job.job_id, job.claim.fence, charge_attempt,
                                   give_up_s=give_up_s)
        if status is None:
            log.warning("job %s not released: lease lost", job.job_id, extra=self._fields("lease_lost", job.job_id))
            return
        self._metrics.on_requeue_status(status)
        log.info("job %s released by its worker: %s", job.job_id, status,
                 extra=self._fields(RELEASE_EVENTS[status], job.job_id, charge_attempt=charge_attempt))

    def _fields(self, event: LifecycleEvent, job_id: str, **fields: object) -> dict[str, object]:
        """``extra=`` of a lifecycle log line about one of this worker's jobs."""
        return job_fields(event, job_id, self._model, self._worker_id, **fields)

    # --- plumbing -------------------------------------------------------------------------------------------

    async def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the engine thread."""
        return await self._engine_thread.call(fn, *args)

    async def _redis(self, fn: Callable[..., Awaitable[T]], *args: Any, give_up_s: float | None = None) -> T:
        """A queue call, retried through Redis outages (restart, failover) and a full Redis (OOM), with jittered
        exponential backoff."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(RETRYABLE_ERRORS), wait=wait_random_exponential(multiplier=0.05, max=2.0),
            stop=stop_after_delay(give_up_s if give_up_s is not None else self._redis_retry_s),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True)
        async for attempt in retrying:
            with attempt:
                return await fn(*args)
        raise AssertionError("unreachable: tenacity reraises")
