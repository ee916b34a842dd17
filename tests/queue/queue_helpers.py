"""Helpers shared by the queue tests (a distinct module name: tests/ is not a package)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

from shared.config import Settings
from shared.schemas import JobSubmission, StreamEvent

MODEL = "tiny"


def make_job(**fields: Any) -> JobSubmission:
    """A valid submission with a random id (as the API makes them) for the test model."""
    values: dict[str, Any] = {"id": secrets.token_urlsafe(12), "model": MODEL, "prompt": "Hello"}
    values.update(fields)
    return JobSubmission(**values)


def queue_settings(redis_url: str, **overrides: Any) -> Settings:
    """Short leases so expiry tests take a fraction of a second."""
    values: dict[str, Any] = {"redis_url": redis_url, "lease_ttl_s": 0.5, "heartbeat_interval_s": 0.1,
                              "max_attempts": 3, "result_ttl_s": 600, "max_queue_length": 100}
    values.update(overrides)
    return Settings(**values)


async def collect(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in stream]
