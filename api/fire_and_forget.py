"""The fire-and-forget loops every API replica runs beside its routes: the batch runner, the webhook delivery and
the job-event reader (the last two only when webhooks are configured). All their state is in Redis, so any
replica continues what another started, and a restart loses nothing."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from api.batches.runner import BatchRunner
from api.batches.store import BatchStore
from api.files import FileStore
from api.metrics import ApiMetrics
from api.webhooks.delivery import WebhookDelivery, WebhookMetrics
from api.webhooks.job_events import JobEventReader
from api.webhooks.outbox import WebhookOutbox, webhooks_enabled
from shared.config import Settings
from shared.queue import JobQueue


def start_loops(redis: Redis, queue: JobQueue, settings: Settings, metrics: ApiMetrics) -> list[asyncio.Task[None]]:
    """Start the loops; the caller cancels the tasks on shutdown. ValueError for webhooks without a secret."""
    outbox = WebhookOutbox(redis, settings)
    runner = BatchRunner(queue, BatchStore(redis, settings.file_retention_s),
                         FileStore(redis, settings.file_retention_s), settings, metrics,
                         on_finished=outbox.batch_event)
    tasks = [asyncio.create_task(runner.run_forever(), name="batch-runner")]
    if webhooks_enabled(settings):
        delivery = WebhookDelivery(redis, settings, WebhookMetrics(metrics.registry))
        tasks.append(asyncio.create_task(delivery.run_forever(), name="webhook-delivery"))
        tasks += [asyncio.create_task(JobEventReader(redis, outbox, queue.keyspace, shard).run_forever(),
                                      name=f"job-events-{shard}") for shard in queue.keyspace.shards]
    return tasks
