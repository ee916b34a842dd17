"""Relay one job's stream events from Redis to a request, subscribing *before* the job is submitted.

A job submitted first and subscribed to second could emit its first tokens in between; the queue's replay log
would cover them, but subscribing first makes the fast path a pure live relay. The stream is opened, iterated
and closed inside one task owned by the relay, so the Redis subscription's lifetime never spans two tasks (the
HTTP response body runs in another task than the endpoint that decided the status code).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from redis.exceptions import RedisError

from api.sse import wait_for_disconnect
from shared.queue import JobQueue, RateState
from shared.schemas import DoneEvent, ErrorEvent, JobRecord, JobSubmission, StreamEvent
from shared.tasks import stop_tasks

log = logging.getLogger(__name__)

_END = object()
CLOSE_TIMEOUT_S = 1.0
# A relay whose stream fails with a Redis error its reader did not ride out (shared/job_stream.py retries the usual
# connection errors itself) reopens the stream after the last event it relayed, pausing RESUME_PAUSE_S before each
# try, until RESUME_S (a relay's ``resume_s``) pass without an event; then the error goes to the caller. Other
# errors go at once.
RESUME_S = 30.0
RESUME_PAUSE_S = 0.25
REDIS_FAILURES = (RedisError, OSError)
# Events relayed ahead of the reader at most. A slow reader stops the relay here, and the relay reads the job's
# log a page at a time (shared/job_stream.py), so a stream held open by a reader that never reads costs a few
# pages of memory, not the job's whole log (docs/security.md has the numbers).
RELAY_BUFFER = 64


class _Failure:
    """An exception raised while relaying, handed to the reader in order."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class JobRelay:
    """Open a job's stream (from ``after_seq``), optionally submit the job, then relay its events.

    ``start()`` returns once the stream is subscribed and the submission accepted, raising whatever the
    submission raised (queue full) so the endpoint can still answer with an error status.
    """

    def __init__(self, queue: JobQueue, job_id: str, *, submission: JobSubmission | None = None,
                 after_seq: int = 0, resume_s: float = RESUME_S) -> None:
        self._queue = queue
        self._resume_s = resume_s
        self.job_id = job_id
        self._submission = submission
        self._after_seq = after_seq  # where the stream opens: the request's, then the last event relayed
        # Unbounded as a queue, bounded by ``_room``: each event takes a place and the reader gives it back; the
        # end and failure markers take none, so they can always be queued, even when the reader has stopped.
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._room = asyncio.Semaphore(RELAY_BUFFER)
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[tuple[JobRecord, bool] | None] | None = None
        self.finished = False  # a DoneEvent or ErrorEvent was relayed: the job needs no cancelling
        self.rate: RateState | None = None  # the key's rate budget after the submission (None: no limits)

    async def start(self) -> tuple[JobRecord, bool] | None:
        """Subscribe, then submit; returns ``queue.submit``'s ``(record, created)`` (None without a submission)."""
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name=f"relay-{self.job_id}")
        try:
            return await self._ready
        except BaseException:
            await self.close()
            raise

    async def _run(self) -> None:
        assert self._ready is not None
        try:
            async with self._queue.open_stream(self.job_id, after_seq=self._after_seq) as stream:
                result = None
                if self._submission is not None:
                    record, created, self.rate = await self._queue.submit_with_rate(self._submission)
                    result = (record, created)
                self._ready.set_result(result)
                async for event in stream:
                    await self._room.acquire()
                    self._events.put_nowait(event)
        except asyncio.CancelledError:
            if not self._ready.done():
                self._ready.cancel()
            raise
        except Exception as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            else:
                self._events.put_nowait(_Failure(exc))
        finally:
            self._events.put_nowait(_END)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The job's events in ``seq`` order, ending after its DoneEvent or ErrorEvent; through a Redis failure
        the stream is reopened after the last event (each seq still comes once)."""
        give_up: float | None = None  # while failing: when the last event is ``resume_s`` old
        while True:
            item = await self._events.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                give_up = give_up if give_up is not None else time.monotonic() + self._resume_s
                await self._reopen(item.exc, give_up)
                continue
            give_up = None
            self._room.release()
            self._after_seq = item.seq
            if isinstance(item, DoneEvent | ErrorEvent):
                self.finished = True
            yield item

    async def _reopen(self, exc: BaseException, give_up: float) -> None:
        """Open the stream again after the last event relayed (never submitting again), trying until ``give_up``;
        raises the failure when it is not Redis's or the time is up."""
        while isinstance(exc, REDIS_FAILURES) and time.monotonic() < give_up:
            log.warning("stream of job %s failed (%r); reopening it after event %d", self.job_id, exc,
                        self._after_seq, extra={"job_id": self.job_id})
            await self.close()
            await asyncio.sleep(RESUME_PAUSE_S)
            self._submission = None
            self._events, self._room = asyncio.Queue(), asyncio.Semaphore(RELAY_BUFFER)
            try:
                await self.start()
                return
            except REDIS_FAILURES as failure:
                exc = failure
        raise exc

    async def final(self) -> DoneEvent | ErrorEvent | None:
        """Wait for the job's terminal event, ignoring the tokens (the non-streaming path)."""
        async for event in self.events():
            if isinstance(event, DoneEvent | ErrorEvent):
                return event
        return None

    async def close(self) -> None:
        """Stop relaying and unsubscribe (idempotent; safe from a cancelled scope)."""
        if self._task is None:
            return
        task, self._task = self._task, None
        # Cancelled again while it runs (a cancellation redis-py takes for a read timeout is lost) and bounded;
        # shielded, so a close from a cancelled scope still stops the task.
        with anyio.CancelScope(shield=True):
            await stop_tasks([task], CLOSE_TIMEOUT_S)


async def run_until_disconnect(work: Callable[[], Awaitable[Any]], receive: Callable[[], Awaitable[Any]]
                               ) -> tuple[Any, bool]:
    """Run ``work()`` while watching the client; returns ``(result, False)``, or ``(None, True)`` when the
    client disconnected first (``work`` is cancelled then). For non-streaming requests that wait on a job."""
    result: Any = None
    disconnected = False

    async def run_work() -> None:
        nonlocal result
        result = await work()
        task_group.cancel_scope.cancel()

    async def watch() -> None:
        nonlocal disconnected
        await wait_for_disconnect(receive)
        disconnected = True
        task_group.cancel_scope.cancel()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run_work)
        task_group.start_soon(watch)
    return result, disconnected
