"""The HTTP API: ``create_app(settings)`` builds a FastAPI app whose lifespan opens Redis and the job queue.

Nothing is opened at import (importing this module must stay fast and must never import torch); each app
owns its Redis client, queue, model catalog and metrics registry, so tests can run several side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from api.deps import Resources
from api.errors import install_error_handlers
from api.fire_and_forget import start_loops
from api.fleet import refresh_forever, refresh_interval_s
from api.fleet_history import FleetHistory
from api.metrics import ApiMetrics
from api.middleware import BodySizeLimitMiddleware, MetricsMiddleware
from api.routes import batches, files, fleet_view, health, job_list, jobs, openai, responses
from api.routes.console import install_console
from api.tokenization import ModelCatalog
from shared.config import Settings
from shared.queue import JobQueue
from shared.redis_client import is_cluster_url, open_client
from shared.tasks import stop_tasks

log = logging.getLogger(__name__)

TASK_STOP_S = 2.0  # how long shutdown waits for the background loops to unwind
EXPIRE_INTERVAL_S = 1.0  # how late the API notices a queued job past its deadline, at most
MULTIPART_OVERHEAD_BYTES = 65_536  # an upload's multipart framing and form fields, beyond the file itself


def reap_interval_s(settings: Settings) -> float:
    """How often the API reaps expired leases: a few times per lease TTL, so a dead worker's jobs go back
    to the queue well within one TTL of its lease running out (the workers reap too; this covers none)."""
    return max(0.5, settings.lease_ttl_s / 3)


async def _reap_forever(queue: JobQueue, metrics: ApiMetrics, interval_s: float) -> None:
    """Requeue jobs whose worker lease expired. A failure (Redis down) is logged and retried next round."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            reaped = await queue.reap()
            for job in reaped:
                metrics.job_reaped(job.model, job.status)
            if reaped:
                log.info("reaped %d jobs with expired leases", len(reaped))
        except Exception:
            log.warning("reaping expired leases failed; retrying in %.1f s", interval_s, exc_info=True)


async def _store_config(queue: JobQueue) -> None:
    """Store the settings the scripts read (ts:config) for other backends; when Redis is not there yet, the
    first submit or cancel stores them."""
    try:
        await queue.publish_config()
    except Exception:
        log.warning("could not store the script config in Redis yet; the first submit will", exc_info=True)


async def _expire_forever(queue: JobQueue, metrics: ApiMetrics, served_model: str) -> None:
    """Expire queued jobs past their start-by time, every model each ``EXPIRE_INTERVAL_S``. A worker's claims do
    it too, but a worker with no free seat does not claim, and a model may have no worker at all."""
    while True:
        await asyncio.sleep(EXPIRE_INTERVAL_S)
        try:
            for model in {served_model, *await queue.model_names()}:
                if expired := await queue.expire(model):
                    metrics.jobs_expired(model, expired)
                    log.info("expired %d queued jobs of %s past their deadline", expired, model)
        except Exception:
            log.warning("expiring overdue jobs failed; retrying in %.1f s", EXPIRE_INTERVAL_S, exc_info=True)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the Redis client, queue and catalog; run the reaper; close them all on shutdown."""
    settings: Settings = app.state.settings
    if settings.redis_url is None:
        raise ValueError("redis_url: the API needs a Redis URL (run_api starts an embedded Redis when unset)")
    # A bounded pool: a burst of requests (10,000 streams opening at once) waits for a connection rather than
    # opening one each; every open stream's live events come over one shared pub/sub connection
    # (shared/live_channels.py), so open streams hold no connection of their own.
    if is_cluster_url(settings.redis_url):  # per node: a pool of up to redis_max_connections
        client = await open_client(settings.redis_url, max_connections=settings.redis_max_connections)
    else:
        pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, health_check_interval=30,
                                                        max_connections=settings.redis_max_connections, timeout=30)
        client = aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both
    queue = JobQueue(client, settings)
    app.state.resources = Resources(redis=client, queue=queue,
                                    catalog=ModelCatalog(queue, settings.served_model_name,
                                                         tokenize_threads=settings.tokenize_threads))
    metrics: ApiMetrics = app.state.metrics
    tasks = [asyncio.create_task(_store_config(queue), name="store-config"),
             asyncio.create_task(_reap_forever(queue, metrics, reap_interval_s(settings)), name="lease-reaper"),
             asyncio.create_task(_expire_forever(queue, metrics, settings.served_model_name), name="job-expirer"),
             asyncio.create_task(refresh_forever(metrics.fleet, queue, settings.served_model_name,
                                                 refresh_interval_s(settings.heartbeat_interval_s),
                                                 app.state.fleet_history),
                                 name="fleet-metrics")]
    tasks += start_loops(client, queue, settings, metrics)
    try:
        yield
    finally:
        await stop_tasks(tasks, TASK_STOP_S)
        await queue.live_channels.aclose()
        await client.aclose()


def create_app(settings: Settings) -> FastAPI:
    """The tokenspool API for ``settings`` (routes, error bodies, body limit, metrics)."""
    # /docs and /redoc with Swagger UI and ReDoc served from the fastapi-offline wheel, not a CDN: the
    # banner of `tokenspool up` points to /docs, and the service must work on a machine without internet.
    app = FastAPIOffline(
        title="tokenspool",
        summary="Queue-backed LLM generation: OpenAI-compatible and job APIs over Redis",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    metrics = ApiMetrics(settings.tenant_policies())
    app.state.metrics = metrics
    app.state.fleet_history = FleetHistory(refresh_interval_s(settings.heartbeat_interval_s))
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(job_list.router)
    app.include_router(fleet_view.router)
    install_console(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    # Added last = outermost: metrics see every answer, including the body limit's 413.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       path_limits={"/v1/files": settings.file_max_bytes + MULTIPART_OVERHEAD_BYTES})
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
