"""``GET /v1/fleet``: the fleet as the console shows it: queue depth per model and priority, live workers with
their engine state, throughput and running jobs, and the last minutes of history (``api.fleet_history``).

Tenant-isolated: a worker's running jobs are listed by id only when they are the caller's; the others are
counted. Queue depths and worker state are the same numbers ``/metrics`` already shows to anyone.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from api.auth import can_access
from api.deps import FleetHistoryDep, OwnerDep, QueueDep, SettingsDep
from api.fleet import FleetSnapshot
from api.fleet_history import FleetPoint

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])


class QueueView(BaseModel):
    model: str
    depth_by_priority: dict[int, int]
    num_queued: int
    num_live_workers: int


class WorkerView(BaseModel):
    id: str
    model: str
    max_num_seqs: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    tokens_per_s: float
    heartbeat_at: float
    started_at: float
    your_job_ids: list[str]
    num_other_jobs: int


class FleetView(BaseModel):
    queues: list[QueueView]
    workers: list[WorkerView]
    num_dead_letters: int
    history: list[FleetPoint]


@router.get("", response_model=FleetView)
async def fleet(queue: QueueDep, settings: SettingsDep, history: FleetHistoryDep, owner: OwnerDep) -> FleetView:
    """Read now (queues, workers, running jobs); the history is the API's own record of recent refreshes."""
    snapshot = await FleetSnapshot.read(queue, settings.served_model_name)
    running = await queue.running_jobs()
    workers = []
    for w in snapshot.workers:
        owners = [(job_id, job_owner) for job_id, worker_id, job_owner in running if worker_id == w.id]
        mine = [job_id for job_id, job_owner in owners if can_access(owner, job_owner)]
        workers.append(WorkerView(id=w.id, model=w.model, max_num_seqs=w.max_num_seqs, num_running=w.num_running,
                                  num_waiting=w.num_waiting, kv_cache_usage=w.kv_cache_usage,
                                  tokens_per_s=history.tokens_per_s(w.id), heartbeat_at=w.heartbeat_at,
                                  started_at=w.started_at, your_job_ids=sorted(mine),
                                  num_other_jobs=len(owners) - len(mine)))
    queues = [QueueView(model=model, depth_by_priority=depths, num_queued=sum(depths.values()),
                        num_live_workers=sum(w.model == model for w in snapshot.workers))
              for model, depths in snapshot.queue_depths.items()]
    return FleetView(queues=queues, workers=workers, num_dead_letters=snapshot.num_dead_letters,
                     history=history.points())
