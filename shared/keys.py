"""Every Redis key, channel and TTL tokenspool uses, in one place (see docs/protocol.md).

All names start with ``ts:``. The keys of one job share the hash tag ``{<job_id>}`` and the keys of one
model's queue share ``{<model>}``, so each group maps to one Cluster slot. The transition scripts (submit,
claim, reap, ...) nevertheless touch a model's queue, the global in-flight set and a job's keys atomically,
and claim/reap only learn job ids inside the script; tokenspool therefore runs on a single Redis node (with
replicas if wanted), not on Redis Cluster. The tags keep a later port (a queue per slot) a rename away.

Scripts that derive job keys from ids they discover (claim, reap, cancel) receive the prefix and suffixes
defined here as arguments, so no key format is ever spelled a second time in Lua.
"""

from __future__ import annotations

PREFIX = "ts:"

# A job's keys are JOB_PREFIX + job_id + one of the suffixes below.
JOB_PREFIX = f"{PREFIX}job:{{"
JOB_SUFFIX = "}"
LOG_SUFFIX = "}:log"
LIVE_SUFFIX = "}:live"

INFLIGHT = f"{PREFIX}inflight"  # zset: job_id -> lease deadline (Redis server time, seconds)
DEAD_LETTER = f"{PREFIX}dead"  # zset: job_id -> time it was given up on
WORKERS = f"{PREFIX}workers"  # zset: worker_id -> last heartbeat (Redis server time)
MODEL_CARDS = f"{PREFIX}models"  # hash: served model name -> ModelCard JSON
# hash: the key layout and the settings the scripts need (result TTL, queue cap, ...), published by every API and
# worker at start, so a script called by another backend needs nothing of the service's settings from its caller.
CONFIG = f"{PREFIX}config"

# A dead-letter entry and a stale worker entry are pruned after this many seconds.
DEAD_LETTER_KEEP_S = 7 * 86_400
# A worker's WorkerInfo key lives this many lease TTLs past its last heartbeat.
WORKER_INFO_TTL_LEASES = 3
# Idempotency keys of jobs that are still queued or running never expire; at the job's terminal
# transition they get the job's result TTL.


def job(job_id: str) -> str:
    """Hash: the job record (status, submission JSON, result JSON, timestamps, fence, seq counter)."""
    return f"{JOB_PREFIX}{job_id}{JOB_SUFFIX}"


def job_log(job_id: str) -> str:
    """Stream: the job's replay log; entry id ``<seq>-0``, fields ``seq`` and ``data`` (event JSON)."""
    return f"{JOB_PREFIX}{job_id}{LOG_SUFFIX}"


def job_live(job_id: str) -> str:
    """Pub/sub channel: every event appended to the replay log is also published here, same JSON."""
    return f"{JOB_PREFIX}{job_id}{LIVE_SUFFIX}"


QUEUE_PREFIX = f"{PREFIX}queue:{{"
QUEUE_SUFFIX = "}"
QUEUE_SEQ_SUFFIX = "}:seq"
QUEUE_WAKE_SUFFIX = "}:wake"


def queue(model: str) -> str:
    """Sorted set: queued job ids of one model, score ``-priority * 2**32 + seq`` (lowest first)."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_SUFFIX}"


def queue_seq(model: str) -> str:
    """Counter: the FIFO sequence number of the model's latest submission."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_SEQ_SUFFIX}"


def queue_wake(model: str) -> str:
    """Pub/sub channel: a job id each time one enters the model's queue (submitted or requeued), so idle
    workers claim at once instead of at their next poll."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_WAKE_SUFFIX}"


# Fair share, deadlines and rate limits (docs/protocol.md, "Tenants"). A tenant is a job's owner (the hash of its
# API key), or ``-`` for jobs without one. Every key below carries the model's hash tag, so one model's queue,
# its tenants, deadlines and rate budgets map to one Cluster slot.
QUEUE_TENANTS_SUFFIX = "}:tenants"
QUEUE_VTIME_SUFFIX = "}:vtime"
QUEUE_TENANT_SUFFIX = "}:tenant:"
QUEUE_DEADLINES_SUFFIX = "}:deadlines"
QUEUE_RATE_SUFFIX = "}:rate:"
NO_OWNER_TENANT = "-"


def tenant_of(owner: str | None) -> str:
    """The fair-share tenant (and rate-limit budget) of a job: its owner, or ``-`` without one."""
    return owner or NO_OWNER_TENANT


def queue_tenants(model: str) -> str:
    """Sorted set: the tenants with queued jobs of the model, scored by their fair-share weight."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_TENANTS_SUFFIX}"


def queue_vtime(model: str) -> str:
    """Hash: tenant -> virtual time (tokens served / weight, start-time fair queuing); field ``*`` is the
    queue's virtual time (the start tag of the latest claim)."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_VTIME_SUFFIX}"


def queue_tenant(model: str, tenant: str) -> str:
    """Sorted set: the tenant's queued job ids of the model, same scores as in ``queue(model)``."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_TENANT_SUFFIX}{tenant}"


def queue_deadlines(model: str) -> str:
    """Sorted set: queued job ids of the model that must start by a time (Redis server time, seconds)."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_DEADLINES_SUFFIX}"


def queue_rate(model: str, tenant: str) -> str:
    """Hash: the tenant's rate-limit state for the model (GCRA arrival times ``tat_r``/``tat_t``, unfinished
    jobs ``jobs``)."""
    return f"{QUEUE_PREFIX}{model}{QUEUE_RATE_SUFFIX}{tenant}"


IDEMPOTENCY_PREFIX = f"{PREFIX}idem:"


def idempotency(owner: str | None, key: str) -> str:
    """String: the job id submitted under ``key`` by ``owner`` (``-`` when there is no owner)."""
    return f"{IDEMPOTENCY_PREFIX}{owner or '-'}:{key}"


WORKER_PREFIX = f"{PREFIX}worker:"
WORKER_CANCELS_SUFFIX = ":cancels"
CONTROL_PREFIX = f"{PREFIX}control:"


def worker_info(worker_id: str) -> str:
    """String: the worker's latest WorkerInfo JSON, expiring when its heartbeats stop."""
    return f"{WORKER_PREFIX}{worker_id}"


def worker_cancels(worker_id: str) -> str:
    """Set: ids of the worker's running jobs whose cancellation it has not finalised yet (durable)."""
    return f"{WORKER_PREFIX}{worker_id}{WORKER_CANCELS_SUFFIX}"


def control(worker_id: str) -> str:
    """Pub/sub channel: job ids the worker must abort now (the fast path beside ``worker_cancels``)."""
    return f"{CONTROL_PREFIX}{worker_id}"


OWNER_PREFIX = f"{PREFIX}owner:"
OWNER_JOBS_SUFFIX = ":jobs"
# An owner's recent-jobs index keeps its newest entries only (older ones are trimmed at each submission).
OWNER_JOBS_KEEP = 500


def owner_jobs(owner: str | None) -> str:
    """Sorted set: the job ids an owner submitted (``-`` when there is no owner), scored by creation time; the
    newest ``OWNER_JOBS_KEEP``, expiring ``result_ttl_s`` after the owner's last submission. The console's job
    list reads it; an entry whose job expired is skipped when read."""
    return f"{OWNER_PREFIX}{owner or '-'}{OWNER_JOBS_SUFFIX}"


# --- files and batches (the OpenAI Files and Batch APIs, api/files.py, api/batches/) -------------------------
FILE_PREFIX = f"{PREFIX}file:{{"
FILES_PREFIX = f"{PREFIX}files:"
BATCH_PREFIX = f"{PREFIX}batch:{{"
BATCHES_PREFIX = f"{PREFIX}batches:"
BATCHES_ACTIVE = f"{PREFIX}batches:active"  # zset: batch_id -> created_at, batches a runner must advance


def file(file_id: str) -> str:
    """Hash: an uploaded or generated file (metadata fields and ``content``), expiring at its retention time."""
    return f"{FILE_PREFIX}{file_id}}}"


def files_of(owner: str | None) -> str:
    """Sorted set: the owner's file ids by creation time (ids of expired files are pruned when listed)."""
    return f"{FILES_PREFIX}{owner or '-'}"


def batch(batch_id: str) -> str:
    """Hash: a batch's state (static ``meta`` JSON, ``status``, timestamps, counts, submit cursor, file ids)."""
    return f"{BATCH_PREFIX}{batch_id}}}"


def batch_lines(batch_id: str) -> str:
    """List: the batch's validated lines (custom_id, render options, JobSubmission), index = input line - 1."""
    return f"{BATCH_PREFIX}{batch_id}}}:lines"


def batch_results(batch_id: str) -> str:
    """Hash: line index -> the line's output JSON; written once per line (HSETNX), so no line completes twice."""
    return f"{BATCH_PREFIX}{batch_id}}}:results"


def batch_lease(batch_id: str) -> str:
    """String: the lease of the API replica advancing the batch now (a redis-py lock, expiring)."""
    return f"{BATCH_PREFIX}{batch_id}}}:lease"


def batches_of(owner: str | None) -> str:
    """Sorted set: the owner's batch ids by creation time, for ``GET /v1/batches``."""
    return f"{BATCHES_PREFIX}owner:{owner or '-'}"


def batch_job_id(batch_id: str, index: int) -> str:
    """The job id of line ``index`` of a batch: fixed by the line, so submitting a line twice finds the job."""
    return f"{batch_id}-{index}"


# --- webhooks (api/webhooks/) ---------------------------------------------------------------------------------
JOB_EVENTS = f"{PREFIX}events:jobs"  # stream: one entry (job_id, status) per terminal transition (lib.lua finish)
JOB_EVENTS_MAXLEN = 100_000
JOB_EVENTS_GROUP = "webhooks"  # the consumer group of the API replicas turning job events into deliveries
WEBHOOK_PREFIX = f"{PREFIX}webhook:"
WEBHOOKS_DUE = f"{PREFIX}webhooks:due"  # zset: message id -> time of its next attempt (Redis time)
WEBHOOKS_DEAD = f"{PREFIX}webhooks:dead"  # zset: message id -> time it was given up on


def webhook(message_id: str) -> str:
    """Hash: one delivery (url, payload, event type, attempts, first/last attempt, last error)."""
    return f"{WEBHOOK_PREFIX}{message_id}"
