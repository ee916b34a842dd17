"""The job queue: the Redis job protocol seen from Python (docs/protocol.md), for the API and the workers.

Every state change is one Lua script (``shared/lua``), so the queue stays consistent whatever mix of API
processes, workers and other backends uses it at once. Reads are plain commands. Nothing here imports torch.
The API's side is ``client.py``, the worker's side ``worker.py``, what both share ``base.py``; reading one job's
event stream is ``shared.job_stream``, the pub/sub plumbing ``shared.pubsub``.
"""

from shared.pubsub import TRANSIENT_ERRORS
from shared.queue.base import (
    ClaimedJob,
    QueueFullError,
    RateLimitedError,
    RateState,
    RecoveredJob,
    priority_of_score,
    record_from_fields,
)
from shared.queue.client import ClientSide
from shared.queue.worker import WorkerSide

__all__ = ["TRANSIENT_ERRORS", "ClaimedJob", "JobQueue", "QueueFullError", "RateLimitedError", "RateState",
           "RecoveredJob", "priority_of_score", "record_from_fields"]


class JobQueue(ClientSide, WorkerSide):
    """Both sides of the job protocol over one ``redis.asyncio.Redis`` client: what the API, a worker, a test or
    another Python backend holds (each uses its own side)."""
