"""Stopping asyncio tasks for sure: cancel them, and cancel again those still running.

One ``cancel()`` is not always enough. redis-py can take a cancellation that lands while it waits on a read with
a timeout for that timeout and so lose it: the task carries on, and a loop that calls Redis and logs its errors
(a reaper, a relay) runs on as if never told to stop. A shutdown that awaits such a task waits forever (an API
that did not exit within 30 s of SIGTERM failed CI this way). ``stop_tasks`` repeats the cancellation every
``RECANCEL_INTERVAL_S`` until every task has ended or the time is up; the next one lands at the loop's sleep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

log = logging.getLogger(__name__)

RECANCEL_INTERVAL_S = 0.05


async def stop_tasks(tasks: Collection[asyncio.Task[Any]], timeout_s: float) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end, cancelling again the ones still running;
    returns those that did not end (logged, with their stacks). An exception a task ended with (other than its
    cancellation) is logged too."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_INTERVAL_S, remaining))
    for task in tasks:
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("task %s ended with an error while stopping", task.get_name(), exc_info=exc)
    if pending:
        log.warning("tasks %s did not stop within %s s; leaving them", sorted(t.get_name() for t in pending),
                    timeout_s, extra={"stacks": [repr(t.get_stack()) for t in pending]})
    return pending
