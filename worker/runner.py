"""The step loop: the worker's bridge from the queue to an engine and back.

Data flow (docs/architecture.md): claimed job -> engine requests (``worker.claims``) -> step outputs folded into
each job (``worker.jobs``) -> writes into the outbox (``worker.outbox``), which one task drains to Redis in order
(``worker.job_writer``). Beside the loop, ``worker.control`` renews leases and hears cancellations and wake-ups.
Every engine call runs on the thread that built the engine (``EngineThread``), so the asyncio loop stays free for
leases, cancellations and writes while a step computes; a step's writes go out while the next step computes,
except after a step that produced a job's first token, when the outbox is flushed first (time to first token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import FinishReason, TokenEvent, TokenLogprob
from shared.tasks import stop_tasks
from worker.claims import Claimer, abort_all
from worker.context import WorkerContext
from worker.control import Control
from worker.engine import StepOutput
from worker.engine_thread import EngineThread
from worker.job_writer import JobWriter
from worker.jobs import ActiveJob, model_card, split_request_id, to_token_logprobs
from worker.metrics import WorkerMetrics
from worker.outbox import Finish, Outbox, Publish, Release
from worker.port import EnginePort
from worker.retrying import REDIS_RETRY_S, RETRYABLE_ERRORS, Retrying
from worker.token_bytes import TokenBytes

log = logging.getLogger(__name__)

TASK_STOP_S = 2.0  # how long shutdown waits for the background tasks to unwind

StepResult = list[tuple[StepOutput, list[TokenLogprob] | None]]


class Runner:
    """Serves one model from one engine until ``request_stop``; ``run`` returns the process exit code."""

    def __init__(self, engine: EnginePort, engine_thread: EngineThread, queue: JobQueue, settings: Settings,
                 worker_id: str, redis_retry_s: float = REDIS_RETRY_S, metrics: WorkerMetrics | None = None) -> None:
        ctx = WorkerContext(engine, engine_thread, queue, Retrying(redis_retry_s),
                            metrics or WorkerMetrics(settings.served_model_name), settings, worker_id)
        self._ctx = ctx
        self._active: dict[str, ActiveJob] = {}
        self._writer = JobWriter(ctx)
        self._outbox = Outbox(self._writer)
        self._claimer = Claimer(ctx)
        self._control = Control(ctx, model_card(settings.served_model_name, engine), self._active)
        self._token_bytes = TokenBytes(engine.tokenizer)
        self._stop = asyncio.Event()
        self._next_poll_at = 0.0  # time.monotonic() when the worker claims next even without a nudge

    def request_stop(self) -> None:
        """SIGTERM: stop claiming, finish running jobs within ``drain_timeout_s``, release the rest."""
        if not self._stop.is_set():
            log.info("worker %s draining (%d jobs running)", self._ctx.worker_id, len(self._active))
        self._stop.set()
        self._control.nudge.set()

    async def run(self) -> int:
        """The main loop, with the outbox and the background tasks running beside it."""
        await self._control.register()
        self._outbox.start()
        tasks = self._control.start()
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
                drain_deadline = drain_deadline or time.monotonic() + self._ctx.settings.drain_timeout_s
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
            await asyncio.wait_for(self._control.nudge.wait(), max(0.0, self._next_poll_at - time.monotonic()))

    async def _fill(self) -> None:
        """Claim when a job may be waiting: after a wake message, or at the next poll. A queue found empty is not
        asked again until then, so a busy worker spends no round trip per step on it."""
        nudge = self._control.nudge
        if not nudge.is_set() and time.monotonic() < self._next_poll_at:
            return
        nudge.clear()  # before claiming: a job queued from now on sets it again
        self._next_poll_at = time.monotonic() + self._ctx.settings.claim_poll_s
        jobs, may_hold_more = await self._claimer.claim(self._active)
        self._active.update((job.job_id, job) for job in jobs)
        if may_hold_more:
            nudge.set()  # look again next step (once a seat is free)

    async def _step(self) -> bool:
        """One engine step, its writes queued in the outbox. False when the engine failed (its jobs are
        released as crashed and the worker exits)."""
        try:
            outputs = await self._ctx.engine_thread.call(self._step_engine)
        except Exception:
            log.exception("engine step failed; releasing %d jobs", len(self._active))
            for job in self._active.values():
                await self._outbox.put(Release(job, crashed=True))
            self._active.clear()
            await self._outbox.flush()
            return False
        published, finished = self._apply(outputs)
        for job in finished:
            if job.error is not None:  # its other choices may still be in the engine
                await self._ctx.engine_thread.call(abort_all, self._ctx.engine, job.unfinished_request_ids())
        if published:
            await self._outbox.put(Publish(published))
        for job in finished:
            await self._outbox.put(Finish(job))
        if any(not job.first_token_published for job, _ in published):
            await self._outbox.flush()  # a first token: TTFT is worth more than one step's publish time
        return True

    def _apply(self, outputs: StepResult) -> tuple[list[tuple[ActiveJob, list[TokenEvent]]], list[ActiveJob]]:
        """Fold a step's outputs into the jobs: the events to publish per job, and the jobs now done (no longer
        active: the engine is finished with them)."""
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

    def _step_engine(self) -> StepResult:
        """Engine thread: a step, with logprob token texts decoded here (the tokenizer lives on this thread)."""
        started = time.perf_counter()
        outputs = self._ctx.engine.step()
        duration_s = time.perf_counter() - started
        stats = self._ctx.engine.stats()
        # Sequences computed in the step: those still running after it plus those it finished.
        batch_size = stats.num_running + sum(out.finished for out in outputs)
        self._ctx.metrics.on_step(duration_s, batch_size, sum(len(out.new_token_ids) for out in outputs), stats)
        tokenizer = self._ctx.engine.tokenizer
        return [(out, to_token_logprobs(out.logprobs, tokenizer, self._token_bytes) if out.logprobs else None)
                for out in outputs]

    async def _apply_control(self) -> None:
        """Drop jobs whose lease was lost; finish jobs a client cancelled (their text so far, as ``abort``) and
        jobs past their timeout (as ``timeout``).

        A lost lease is matched by fence, not only by job id: the queue may have handed the job back to this
        very worker (a new attempt, a new fence) before the old attempt's refusal arrived.
        """
        for job_id, fence in self._control.take_lost() | self._writer.take_lost():
            job = self._active.get(job_id)
            if job is not None and job.claim.fence == fence:
                del self._active[job_id]
                await self._ctx.engine_thread.call(abort_all, self._ctx.engine, job.unfinished_request_ids())
                log.warning("job %s dropped: lease lost", job_id, extra=self._ctx.fields("lease_lost", job_id))
        for job_id in self._control.take_cancelled() & self._active.keys():
            await self._stop_job(job_id, "abort")
        now = time.monotonic()
        for job_id in [job.job_id for job in self._active.values() if job.past_deadline(now)]:
            log.info("job %s past its timeout; stopping it", job_id, extra=self._ctx.fields("expired", job_id))
            await self._stop_job(job_id, "timeout")

    async def _stop_job(self, job_id: str, reason: FinishReason) -> None:
        """End an active job now with its text so far: its unfinished choices get ``reason``."""
        job = self._active.pop(job_id)
        await self._ctx.engine_thread.call(abort_all, self._ctx.engine, job.unfinished_request_ids())
        job.abort(reason)
        await self._outbox.put(Finish(job))  # behind its last events, by construction

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        """Release what did not finish (uncharged), stop the background tasks, leave the registry.

        Redis gets one lease TTL to answer: after that the leases expire and reapers recover the jobs anyway,
        so waiting longer would only delay the exit.
        """
        await stop_tasks(tasks, TASK_STOP_S)
        patience = self._ctx.settings.lease_ttl_s
        try:
            for job in self._active.values():
                await self._ctx.engine_thread.call(abort_all, self._ctx.engine, job.unfinished_request_ids())
                await self._outbox.put(Release(job, crashed=False, give_up_s=patience))
            await self._outbox.close()
            await self._ctx.redis.within(patience, self._ctx.queue.deregister_worker, self._ctx.worker_id)
        except RETRYABLE_ERRORS as exc:
            log.error("could not release jobs or deregister (%s); their leases will expire", exc)
        finally:
            self._active.clear()
            self._ctx.engine_thread.shutdown()
