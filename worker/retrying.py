"""Queue calls that ride out Redis outages (a restart, a failover) and a full Redis (OOM), with jittered backoff."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from redis.exceptions import OutOfMemoryError
from tenacity import AsyncRetrying, before_sleep_log, retry_if_exception_type, stop_after_delay, wait_random_exponential

from shared.queue import TRANSIENT_ERRORS

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

REDIS_RETRY_S = 300.0  # a Redis outage longer than this ends the worker (exit 1) for its supervisor to restart
# What the worker waits out, retrying: an outage, and a full Redis (maxmemory with noeviction refuses writes until
# results expire or memory is added). Exiting instead would restart the worker into the same wall and lose the
# work of every running job.
RETRYABLE_ERRORS = (*TRANSIENT_ERRORS, OutOfMemoryError)


class Retrying:
    """Calls queue methods, retrying retryable errors for up to ``give_up_s`` (then the error is raised)."""

    def __init__(self, give_up_s: float = REDIS_RETRY_S) -> None:
        self.give_up_s = give_up_s

    async def __call__(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.within(self.give_up_s, fn, *args, **kwargs)

    async def within(self, give_up_s: float, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """As a call, but giving up after ``give_up_s`` (shutdown waits one lease, not the full patience)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(RETRYABLE_ERRORS), wait=wait_random_exponential(multiplier=0.05, max=2.0),
            stop=stop_after_delay(give_up_s), before_sleep=before_sleep_log(log, logging.WARNING), reraise=True)
        async for attempt in retrying:
            with attempt:
                return await fn(*args, **kwargs)
        raise AssertionError("unreachable: tenacity reraises")
