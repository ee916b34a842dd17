"""shared/tasks.py: tasks that lose a cancellation are stopped anyway, those that refuse every one are reported."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.tasks import stop_tasks


async def _loses_first_cancellations(lose: int, refuse: asyncio.Event | None = None) -> None:
    """A loop whose first ``lose`` cancellations vanish, as when redis-py takes one for a read timeout (and,
    while ``refuse`` is set, every one)."""
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lose == 0 and not (refuse and refuse.is_set()):
                raise
            lose = max(0, lose - 1)
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()


async def test_a_task_that_loses_its_cancellation_is_stopped() -> None:
    once = asyncio.create_task(_loses_first_cancellations(1))
    await asyncio.sleep(0.02)
    once.cancel()
    await asyncio.sleep(0.2)
    assert not once.done()  # one cancel() was not enough

    lossy = asyncio.create_task(_loses_first_cancellations(3))
    await asyncio.sleep(0.02)
    assert await stop_tasks([once, lossy], timeout_s=2.0) == set()
    assert once.cancelled() and lossy.cancelled()


async def test_a_task_that_refuses_to_stop_is_returned_and_logged_after_the_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    refuse = asyncio.Event()
    refuse.set()
    stubborn = asyncio.create_task(_loses_first_cancellations(0, refuse), name="stubborn-loop")
    quick = asyncio.create_task(asyncio.sleep(10))
    await asyncio.sleep(0.02)  # both running (a task cancelled before its first step never runs)
    started = asyncio.get_running_loop().time()
    with caplog.at_level(logging.WARNING, logger="shared.tasks"):
        assert await stop_tasks([stubborn, quick], timeout_s=0.3) == {stubborn}
    assert "stubborn-loop" in caplog.text and "did not stop" in caplog.text
    assert 0.3 <= asyncio.get_running_loop().time() - started < 1.0
    assert quick.cancelled() and not stubborn.done()
    refuse.clear()
    assert await stop_tasks([stubborn], timeout_s=1.0) == set()


async def test_finished_tasks_are_left_and_their_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def fail() -> None:
        raise ValueError("boom")

    failed = asyncio.create_task(fail(), name="failing-loop")
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="shared.tasks"):
        assert await stop_tasks([failed, done], timeout_s=1.0) == set()
    assert not done.cancelled() and not failed.cancelled()
    assert "failing-loop" in caplog.text and "boom" in caplog.text
