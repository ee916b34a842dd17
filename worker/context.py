"""What the parts of one worker share (claims, control, the job writer, the step loop): one frozen record."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import Settings
from shared.lifecycle_log import LifecycleEvent, job_fields
from shared.queue import JobQueue
from worker.engine_thread import EngineThread
from worker.metrics import WorkerMetrics
from worker.port import EnginePort
from worker.retrying import Retrying


@dataclass(frozen=True)
class WorkerContext:
    """The engine and the thread every call into it runs on, the queue and how its calls are retried, the
    metrics, the settings and the worker's id."""

    engine: EnginePort
    engine_thread: EngineThread
    queue: JobQueue
    redis: Retrying
    metrics: WorkerMetrics
    settings: Settings
    worker_id: str

    @property
    def model(self) -> str:
        """The served model name (and the name of its queue)."""
        return self.settings.served_model_name

    def fields(self, event: LifecycleEvent, job_id: str, **fields: object) -> dict[str, object]:
        """``extra=`` of a lifecycle log line about one of this worker's jobs."""
        return job_fields(event, job_id, self.model, self.worker_id, **fields)
