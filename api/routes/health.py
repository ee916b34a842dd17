"""Liveness, readiness and metrics: unauthenticated, for orchestrators and scrapers."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from api.deps import MetricsDep, ResourcesDep
from api.errors import APIError

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP (nothing else is checked: a Redis outage must not restart us)."""
    return {"status": "ok"}


@router.get("/health")
async def health(resources: ResourcesDep) -> dict[str, str]:
    """vLLM's and TGI's health check: 200 when the API can reach Redis (503 otherwise). Probes and tools written
    for those servers (guidellm, copied Kubernetes probes) work unchanged; ``/readyz`` also needs a worker."""
    try:
        await resources.redis.ping()
    except (RedisError, OSError) as exc:
        log.warning("health: redis unreachable: %s", exc)
        raise APIError(503, f"redis unreachable: {exc}", code="redis_unavailable") from exc
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(resources: ResourcesDep) -> dict[str, str | int]:
    """Ready to take work: Redis answers and at least one worker has a live heartbeat (503 otherwise)."""
    try:
        await resources.redis.ping()
        workers = await resources.queue.live_workers()
    except (RedisError, OSError) as exc:
        log.warning("readiness: redis unreachable: %s", exc)
        raise APIError(503, f"redis unreachable: {exc}", code="redis_unavailable") from exc
    if not workers:
        raise APIError(503, "no live worker", code="no_workers")
    return {"status": "ready", "workers": len(workers)}


@router.get("/metrics", response_class=Response)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
