"""EngineThread: the engine is built and called on one and the same thread, never the event loop's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from worker.engine_thread import EngineThread


async def test_build_and_calls_share_one_thread_off_the_event_loop() -> None:
    engine_thread = EngineThread()
    try:
        built_on = await asyncio.to_thread(engine_thread.build, threading.get_ident)
        called_on = await asyncio.gather(*(engine_thread.call(threading.get_ident) for _ in range(8)))
        assert set(called_on) == {built_on} and built_on != threading.get_ident()
    finally:
        engine_thread.shutdown()


async def test_calls_run_one_at_a_time_in_order() -> None:
    engine_thread, order, inside = EngineThread(), [], []

    def work(i: int) -> None:
        inside.append(i)
        assert len(inside) == 1, "two calls overlapped"
        order.append(i)
        inside.pop()

    try:
        await asyncio.gather(*(engine_thread.call(work, i) for i in range(20)))
        assert order == list(range(20))
    finally:
        engine_thread.shutdown()


async def test_errors_reach_the_caller() -> None:
    engine_thread = EngineThread()
    try:
        with pytest.raises(ZeroDivisionError):
            await engine_thread.call(lambda: 1 / 0)
        with pytest.raises(ValueError, match="bad config"):
            engine_thread.build(lambda: (_ for _ in ()).throw(ValueError("bad config")))
    finally:
        engine_thread.shutdown()
