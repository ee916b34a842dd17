"""FastAPI dependencies and their ``Annotated`` aliases.

Everything a route needs lives on ``app.state`` (put there by ``create_app`` and its lifespan), never in module
globals, so two apps in one process (tests) never share a Redis client, queue or metrics registry.

The dependencies are ``async def`` although none awaits: FastAPI runs plain ``def`` dependencies on its thread
pool, and six thread hops per request cost more than the work they carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from api.auth import authenticate
from api.fleet_history import FleetHistory
from api.metrics import ApiMetrics
from api.tokenization import ModelCatalog
from shared.config import Settings
from shared.queue import JobQueue


@dataclass(frozen=True)
class Resources:
    """What the lifespan opens: one Redis client, the queue on it and the model catalog."""

    redis: aioredis.Redis
    queue: JobQueue
    catalog: ModelCatalog


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> ApiMetrics:
    metrics: ApiMetrics = request.app.state.metrics
    return metrics


async def get_fleet_history(request: Request) -> FleetHistory:
    history: FleetHistory = request.app.state.fleet_history
    return history


async def get_resources(request: Request) -> Resources:
    resources: Resources = request.app.state.resources
    return resources


async def get_queue(resources: Annotated[Resources, Depends(get_resources)]) -> JobQueue:
    return resources.queue


async def get_catalog(resources: Annotated[Resources, Depends(get_resources)]) -> ModelCatalog:
    return resources.catalog


async def get_owner(request: Request, settings: Annotated[Settings, Depends(get_settings)]) -> str | None:
    """The caller's owner tag (hash of its API key), None when auth is off; 401 for a bad key."""
    return authenticate(request, settings)


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[ApiMetrics, Depends(get_metrics)]
ResourcesDep = Annotated[Resources, Depends(get_resources)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
CatalogDep = Annotated[ModelCatalog, Depends(get_catalog)]
FleetHistoryDep = Annotated[FleetHistory, Depends(get_fleet_history)]
OwnerDep = Annotated[str | None, Depends(get_owner)]
