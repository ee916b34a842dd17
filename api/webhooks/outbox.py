"""Webhook events queued for delivery in Redis (``shared.keys.webhook``, ``WEBHOOKS_DUE``).

An event goes to every operator endpoint (``webhook_urls``) and to the job's or batch's own ``webhook_url``, which
is accepted only when its host is in ``webhook_allowed_hosts`` (no request forgery into the operator's network).
Payloads follow the Standard Webhooks shape ``{"type", "timestamp", "data"}``; each (event, endpoint) pair is one
message whose id is derived from both, so queueing an event twice delivers it once.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis

from api.batches.store import BatchState
from api.errors import invalid_request
from shared import keys
from shared.config import Settings
from shared.schemas import JobRecord
from shared.scripts import lua_source

# Batch statuses that raise an event, and the event's type.
BATCH_EVENTS = {"completed": "batch.completed", "failed": "batch.failed", "expired": "batch.expired",
                "cancelled": "batch.cancelled"}


def webhooks_enabled(settings: Settings) -> bool:
    return bool(settings.webhook_urls or settings.webhook_allowed_hosts)


def callback_allowed(settings: Settings, url: str) -> bool:
    """Whether ``url`` is http(s) and its host is in the operator's allow-list."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and (parts.hostname or "") in settings.webhook_allowed_hosts


def check_callback_url(settings: Settings, url: str | None, param: str) -> None:
    """400 unless ``url`` is None or allowed."""
    if url is not None and not callback_allowed(settings, url):
        raise invalid_request(f"{param} must be an http(s) URL whose host the operator allows "
                              "(webhook_allowed_hosts)", param=param, code="webhook_url_not_allowed")


def message_id(event_id: str, url: str) -> str:
    """The ``webhook-id`` of one event sent to one endpoint: the same on every retry and every re-queue."""
    return "msg_" + hashlib.sha256(f"{event_id}\n{url}".encode()).hexdigest()[:32]


def payload(event_type: str, data: dict[str, Any]) -> str:
    return json.dumps({"type": event_type, "timestamp": datetime.now(UTC).isoformat(), "data": data},
                      separators=(",", ":"))


class WebhookOutbox:
    """Queues events for the delivery loop (``api.webhooks.delivery``)."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._enqueue = redis.register_script(lua_source("webhook_enqueue"))

    def targets(self, callback_url: str | None) -> list[str]:
        """The operator endpoints, and the callback when allowed (checked again: settings may have changed)."""
        urls = list(self._settings.webhook_urls)
        if callback_url and callback_allowed(self._settings, callback_url) and callback_url not in urls:
            urls.append(callback_url)
        return urls

    async def publish(self, event_id: str, event_type: str, data: dict[str, Any], callback_url: str | None) -> int:
        """Queue the event for each target; returns how many messages were new."""
        if not webhooks_enabled(self._settings):
            return 0
        body = payload(event_type, data)
        queued = 0
        for url in self.targets(callback_url):
            msg = message_id(event_id, url)
            queued += int(await self._enqueue(keys=[keys.webhook(msg), keys.WEBHOOKS_DUE],
                                              args=[msg, url, body, event_type]))
        return queued

    async def batch_event(self, state: BatchState) -> int:
        """The event of a batch that reached a terminal status."""
        event_type = BATCH_EVENTS.get(state.batch.status)
        if event_type is None:
            return 0
        return await self.publish(f"{state.batch.id}:{state.batch.status}", event_type,
                                  state.batch.model_dump(mode="json"), state.webhook_url)

    async def job_event(self, job: JobRecord, callback_url: str | None) -> int:
        """The event of a job that reached a terminal status (``job.<status>``: any terminal status, so one
        added later, such as ``expired``, raises ``job.expired``)."""
        data = {"object": "job", **job.model_dump(mode="json")}
        return await self.publish(f"{job.id}:{job.status.value}", f"job.{job.status.value}", data, callback_url)
