"""Delivering queued webhooks: at least once, signed as Standard Webhooks specifies, retried with backoff.

Every API replica runs ``run_forever``; ``webhook_claim.lua`` hands each due message to one replica for a lease
(a replica that dies mid-send loses it to another when the lease ends). A 2xx answer delivers a message; any
other answer, a timeout or a refused connection schedules a retry after ``webhook_backoff_s * 2**attempt``
(at most 10 minutes), with the same ``webhook-id``, until ``webhook_retry_s`` after its first attempt; then it is
dead-lettered (``WEBHOOKS_DEAD``), logged and counted. Each attempt is signed anew (the timestamp is the
attempt's), so a receiver's replay window never rejects a late retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis
from standardwebhooks.webhooks import Webhook

from shared import keys
from shared.config import Settings
from shared.pubsub import as_text
from shared.scripts import lua_source

log = logging.getLogger(__name__)

CLAIM_BATCH = 32
MAX_BACKOFF_S = 600.0
DELIVERED_KEEP_S = 86_400  # a delivered message's record (its id blocks a duplicate) lives this long
DEAD_KEEP_S = 7 * 86_400


class WebhookMetrics:
    """Deliveries by outcome and the dead-letter count, in the API's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter("tokenspool_webhook_attempts", "webhook delivery attempts", ["outcome"],
                                registry=registry)
        self.dead = Gauge("tokenspool_webhooks_dead_lettered", "webhook messages given up on (kept 7 days)",
                          registry=registry)


@dataclass(frozen=True)
class Message:
    id: str
    url: str
    payload: str
    event_type: str
    attempts: int
    first_at: float


def signed_headers(signer: Webhook, message_id: str, body: str, now: float) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt."""
    stamp = datetime.fromtimestamp(int(now), tz=UTC)
    return {"webhook-id": message_id, "webhook-timestamp": str(int(now)),
            "webhook-signature": signer.sign(message_id, stamp, body), "content-type": "application/json"}


class WebhookDelivery:
    """The delivery loop of one replica."""

    def __init__(self, redis: Redis, settings: Settings, metrics: WebhookMetrics | None = None) -> None:
        if not settings.webhook_signing_key:
            raise ValueError("webhook_signing_key: webhooks are configured (webhook_urls or webhook_allowed_hosts), so "
                             "a signing secret is required (whsec_<base64>)")
        self._redis = redis
        self._settings = settings
        self._metrics = metrics
        self._signer = Webhook(settings.webhook_signing_key)
        self._claim = redis.register_script(lua_source("webhook_claim"))

    async def run_forever(self, poll_s: float = 0.5) -> None:
        async with httpx.AsyncClient(timeout=self._settings.webhook_timeout_s, follow_redirects=False) as client:
            while True:
                try:
                    sent = await self.run_once(client)
                except Exception:
                    log.warning("webhook delivery round failed; retrying", exc_info=True)
                    sent = 0
                if not sent:
                    await asyncio.sleep(poll_s)

    async def run_once(self, client: httpx.AsyncClient) -> int:
        """Send every due message once (concurrently); returns how many were taken."""
        lease_s = self._settings.webhook_timeout_s + 5
        ids = [as_text(x) for x in await self._claim(keys=[keys.WEBHOOKS_DUE], args=[lease_s, CLAIM_BATCH])]
        messages = [m for i in ids if (m := await self._load(i)) is not None]
        await asyncio.gather(*(self._attempt(client, m) for m in messages))
        if self._metrics is not None:
            self._metrics.dead.set(await self._redis.zcard(keys.WEBHOOKS_DEAD))
        return len(ids)

    async def _load(self, message_id: str) -> Message | None:
        raw = await self._redis.hgetall(keys.webhook(message_id))
        fields = {as_text(k): as_text(v) for k, v in raw.items()}
        if not fields or fields.get("state") != "pending":
            await self._redis.zrem(keys.WEBHOOKS_DUE, message_id)
            return None
        return Message(message_id, fields["url"], fields["payload"], fields["type"], int(fields["attempts"]),
                       float(fields["first_at"]))

    async def _attempt(self, client: httpx.AsyncClient, message: Message) -> None:
        now = time.time()
        error: str | None = None
        try:
            response = await client.post(message.url, content=message.payload.encode(),
                                         headers=signed_headers(self._signer, message.id, message.payload, now))
            if not 200 <= response.status_code < 300:
                error = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is None:
            await self._delivered(message)
        else:
            await self._failed(message, error, now)

    async def _delivered(self, message: Message) -> None:
        key = keys.webhook(message.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"state": "delivered", "attempts": message.attempts + 1,
                                    "delivered_at": f"{time.time():.6f}"})
            pipe.expire(key, DELIVERED_KEEP_S)
            pipe.zrem(keys.WEBHOOKS_DUE, message.id)
            await pipe.execute()
        if self._metrics is not None:
            self._metrics.attempts.labels("delivered").inc()
        log.info("webhook %s (%s) delivered to %s after %d attempts", message.id, message.event_type, message.url,
                 message.attempts + 1)

    async def _failed(self, message: Message, error: str, now: float) -> None:
        attempts = message.attempts + 1
        delay = min(MAX_BACKOFF_S, self._settings.webhook_backoff_s * 2 ** message.attempts)
        key = keys.webhook(message.id)
        give_up = now + delay > message.first_at + self._settings.webhook_retry_s
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"attempts": attempts, "last_error": error[:500]})
            if give_up:
                pipe.hset(key, "state", "dead")
                pipe.expire(key, DEAD_KEEP_S)
                pipe.zrem(keys.WEBHOOKS_DUE, message.id)
                pipe.zadd(keys.WEBHOOKS_DEAD, {message.id: now})
            else:
                pipe.zadd(keys.WEBHOOKS_DUE, {message.id: now + delay})
            await pipe.execute()
        if self._metrics is not None:
            self._metrics.attempts.labels("dead_lettered" if give_up else "failed").inc()
        if give_up:
            log.error("webhook %s (%s) to %s dead-lettered after %d attempts: %s", message.id, message.event_type,
                      message.url, attempts, error)
        else:
            log.warning("webhook %s (%s) to %s failed (attempt %d: %s); retrying in %.1f s", message.id,
                        message.event_type, message.url, attempts, error, delay)
