"""Every Redis key, channel and TTL tokenspool uses, in one place (see docs/protocol.md).

All names start with ``ts:``. Jobs live in **queue shards** (``Settings.queue_shards``, 1 on a single node):
every key a transition script touches (a job's record, log and lease, its model's queue in that shard, the
shard's in-flight and dead-letter sets, idempotency keys, the owner index, the job-event stream) carries the
shard's hash tag ``{<tag>}``, so each script runs in one Cluster hash slot. A job's shard is a function of its
id (``shard_of``: CRC16 of the id modulo the shard count, the CRC Redis Cluster uses for slots), so anyone who
knows the id finds its keys. Shard ``k``'s tag is chosen to hash into the k-th equal part of the slot range
(``shard_tag``), so on a cluster whose masters own equal contiguous slot ranges (what ``redis-cli --cluster
create`` makes) the shards spread over all masters.

Keys that no job script touches (the worker fleet, model cards, batches, files, webhooks) are outside the
shards; those that one script touches together share a fixed tag (``{fleet}``, ``{webhooks}``).

Scripts that derive job keys from ids they discover (claim, reap, cancel) receive the shard's key prefixes as
arguments (``Keyspace.layout``), so no key format is ever spelled a second time in Lua.
"""

from __future__ import annotations

import binascii
import secrets
from dataclasses import dataclass
from functools import cached_property

PREFIX = "ts:"
SLOTS = 16384  # Redis Cluster hash slots

# --- queue shards ---------------------------------------------------------------------------------------------


def crc16(text: str) -> int:
    """CRC16-XMODEM of the UTF-8 text: the checksum Redis Cluster maps keys to slots with (``CRC16 mod 16384``)."""
    return binascii.crc_hqx(text.encode(), 0)


def shard_of(routing_key: str, num_shards: int) -> int:
    """The queue shard of a job id (or of an idempotency scope or tenant): ``CRC16(routing_key) mod num_shards``."""
    return crc16(routing_key) % num_shards


def shard_tag(shard: int, num_shards: int) -> str:
    """The hash tag of shard ``shard`` of ``num_shards``: ``"<shard>"``, else ``"<shard>.<n>"`` for the least n
    whose slot lies in the middle half of the shard's equal part of the slot range (``"0"`` for one shard)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    low, high = shard * SLOTS // num_shards, (shard + 1) * SLOTS // num_shards
    margin = (high - low) // 4 if num_shards > 1 else 0
    n = 0
    while True:
        tag = f"{shard}.{n}" if n else str(shard)
        if low + margin <= crc16(tag) % SLOTS < high - margin:
            return tag
        n += 1


# A job's and a model queue's keys are a shard's prefix + the id or model + one of these suffixes; the scripts get
# the same prefixes and suffixes (``Keyspace.layout``), so no format is spelled a second time.
LOG_SUFFIX, LIVE_SUFFIX = ":log", ":live"
SEQ_SUFFIX, WAKE_SUFFIX, TENANTS_SUFFIX, VTIME_SUFFIX = ":seq", ":wake", ":tenants", ":vtime"
TENANT_SUFFIX, DEADLINES_SUFFIX, RATE_SUFFIX = ":tenant:", ":deadlines", ":rate:"

SHARDS = f"{PREFIX}shards"  # string: the shard tags, comma-separated in shard order (written by API and workers)


@dataclass(frozen=True)
class Keyspace:
    """The shard-scoped keys of a deployment with ``num_shards`` queue shards (``Settings.queue_shards``).

    A job's keys follow from its id alone (``shard_of``); a model's queue, the in-flight and dead-letter sets,
    the config copy, idempotency keys, owner indexes and the job-event stream exist once per shard.
    """

    num_shards: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_shards <= 1024:
            raise ValueError(f"queue_shards must be in [1, 1024], got {self.num_shards}")

    @cached_property
    def tags(self) -> tuple[str, ...]:
        """Each shard's hash tag, in shard order."""
        return tuple(shard_tag(k, self.num_shards) for k in range(self.num_shards))

    @property
    def shards(self) -> range:
        return range(self.num_shards)

    def shard_of(self, routing_key: str) -> int:
        # One shard (the default): no checksum per key on the publish path, which names every job of every step.
        return 0 if self.num_shards == 1 else shard_of(routing_key, self.num_shards)

    def _in(self, shard: int) -> str:
        return f"{{{self.tags[shard]}}}"

    def _prefix(self, kind: str, shard: int) -> str:
        """``ts:<kind>:{<tag>}:``: the start of every per-shard key of one kind (job, queue, idem, cancels)."""
        return f"{PREFIX}{kind}:{self._in(shard)}:"

    # -- a job's keys (shard of its id) --
    def job(self, job_id: str) -> str:
        """Hash: the job record (status, submission JSON, result JSON, timestamps, fence, seq counter)."""
        return f"{self._prefix('job', self.shard_of(job_id))}{job_id}"

    def job_log(self, job_id: str) -> str:
        """Stream: the job's replay log; entry id ``<seq>-0``, fields ``seq`` and ``data`` (event JSON)."""
        return f"{self.job(job_id)}{LOG_SUFFIX}"

    def job_live(self, job_id: str) -> str:
        """Shard pub/sub channel (SPUBLISH): every event appended to the replay log is also published here."""
        return f"{self.job(job_id)}{LIVE_SUFFIX}"

    # -- a model's queue in one shard --
    def queue(self, model: str, shard: int) -> str:
        """Sorted set: queued job ids of the model in the shard, score ``-priority * 2**32 + seq`` (lowest first)."""
        return f"{self._prefix('queue', shard)}{model}"

    def queue_seq(self, model: str, shard: int) -> str:
        """Counter: the FIFO sequence number of the model's latest submission to the shard."""
        return f"{self.queue(model, shard)}{SEQ_SUFFIX}"

    def queue_wake(self, model: str, shard: int) -> str:
        """Pub/sub channel (PUBLISH, cluster-wide): a job id each time one enters the model's queue in the
        shard, so idle workers claim at once instead of at their next poll."""
        return f"{self.queue(model, shard)}{WAKE_SUFFIX}"

    def queue_tenants(self, model: str, shard: int) -> str:
        """Sorted set: the tenants with queued jobs of the model in the shard, scored by fair-share weight."""
        return f"{self.queue(model, shard)}{TENANTS_SUFFIX}"

    def queue_vtime(self, model: str, shard: int) -> str:
        """Hash: tenant -> virtual time (tokens served / weight, start-time fair queuing); field ``*`` is the
        queue's virtual time (the start tag of the latest claim)."""
        return f"{self.queue(model, shard)}{VTIME_SUFFIX}"

    def queue_tenant(self, model: str, tenant: str, shard: int) -> str:
        """Sorted set: the tenant's queued job ids of the model in the shard, same scores as the queue."""
        return f"{self.queue(model, shard)}{TENANT_SUFFIX}{tenant}"

    def queue_deadlines(self, model: str, shard: int) -> str:
        """Sorted set: queued job ids of the model that must start by a time (Redis server time, seconds)."""
        return f"{self.queue(model, shard)}{DEADLINES_SUFFIX}"

    def queue_rate(self, model: str, tenant: str, shard: int) -> str:
        """Hash: the tenant's rate-limit state for the model (GCRA arrival times ``tat_r``/``tat_t``, unfinished
        jobs ``jobs``); a tenant with limits has all its jobs in one shard (``placement``)."""
        return f"{self.queue(model, shard)}{RATE_SUFFIX}{tenant}"

    # -- per shard --
    def inflight(self, shard: int) -> str:
        """Sorted set: the shard's running job ids -> lease deadline (Redis server time, seconds)."""
        return f"{PREFIX}inflight:{self._in(shard)}"

    def dead_letter(self, shard: int) -> str:
        """Sorted set: the shard's jobs given up on -> the time they were."""
        return f"{PREFIX}dead:{self._in(shard)}"

    def config(self, shard: int) -> str:
        """Hash: the shard's key layout and the settings the scripts need (result TTL, queue cap, ...), stored by
        every API and worker at start, so a script called by another backend needs nothing from its caller."""
        return f"{PREFIX}config:{self._in(shard)}"

    def idempotency(self, owner: str | None, key: str, shard: int) -> str:
        """String: the job id submitted under ``key`` by ``owner`` (``-`` when there is no owner)."""
        return f"{self._prefix('idem', shard)}{idempotency_scope(owner, key)}"

    def owner_jobs(self, owner: str | None, shard: int) -> str:
        """Sorted set: the job ids of the shard an owner submitted (``-`` without owner), scored by creation time;
        the newest ``OWNER_JOBS_KEEP``, expiring ``result_ttl_s`` after the owner's last submission there."""
        return f"{PREFIX}owner:{self._in(shard)}:{owner or '-'}:jobs"

    def job_events(self, shard: int) -> str:
        """Stream: one entry (job_id, status) per terminal transition of the shard's jobs (webhooks read it)."""
        return f"{PREFIX}events:jobs:{self._in(shard)}"

    def worker_cancels(self, worker_id: str, shard: int) -> str:
        """Set: ids of the worker's running jobs in the shard whose cancellation it has not finalised (durable)."""
        return f"{self._prefix('cancels', shard)}{worker_id}"

    # -- placement --
    def placement(self, job_id: str, owner: str | None, idempotency_key: str | None, rate_limited: bool) -> int:
        """The shard a submission must go to: its tenant's when the tenant has rate limits (its budget is one
        key), else its idempotency scope's when it has a key (a retry finds the first job), else its id's."""
        fixed = self._fixed_placement(owner, idempotency_key, rate_limited)
        return self.shard_of(job_id) if fixed is None else fixed

    def _fixed_placement(self, owner: str | None, idempotency_key: str | None, rate_limited: bool) -> int | None:
        """The shard a submission must go to whatever its id, or None when its id decides (``placement``)."""
        if rate_limited:
            return self.shard_of(tenant_of(owner))
        if idempotency_key is not None:
            return self.shard_of(idempotency_scope(owner, idempotency_key))
        return None

    def fit_id(self, base: str, shard: int) -> str:
        """``base`` if it belongs to ``shard``, else ``base-<n>`` for the least n that does: a job id in the shard
        a submission must go to, deterministic for a given base (batch lines keep fixed ids)."""
        if self.shard_of(base) == shard:
            return base
        n = 1
        while self.shard_of(f"{base}-{n}") != shard:
            n += 1
        return f"{base}-{n}"

    def job_id_for(self, owner: str | None, idempotency_key: str | None, rate_limited: bool,
                   base: str | None = None) -> str:
        """An id for a new job of ``owner`` in the shard its submission must go to (``placement``), so its keys
        follow from the id alone. ``base``: a fixed id to start from (batch lines), kept when it fits (``fit_id``);
        else a fresh random one (32 hex characters, 128 random bits, about ``num_shards`` draws)."""
        shard = self._fixed_placement(owner, idempotency_key, rate_limited)
        if shard is None:  # placed by its id: any id will do
            return base or secrets.token_hex(16)
        if base is not None:
            return self.fit_id(base, shard)
        while True:
            job_id = secrets.token_hex(16)
            if self.shard_of(job_id) == shard:
                return job_id

    def layout(self, shard: int) -> dict[str, str]:
        """The shard's key prefixes and suffixes as the scripts derive keys from ids (``ctx``, ``ts:config:{...}``)."""
        return {
            "shard": str(shard), "num_shards": str(self.num_shards), "tag": self.tags[shard],
            "job_prefix": self._prefix("job", shard), "job_suffix": "", "log_suffix": LOG_SUFFIX,
            "live_suffix": LIVE_SUFFIX, "queue_prefix": self._prefix("queue", shard), "queue_suffix": "",
            "wake_suffix": WAKE_SUFFIX, "seq_suffix": SEQ_SUFFIX, "tenants_suffix": TENANTS_SUFFIX,
            "vtime_suffix": VTIME_SUFFIX, "tenant_suffix": TENANT_SUFFIX, "deadlines_suffix": DEADLINES_SUFFIX,
            "idem_prefix": self._prefix("idem", shard), "cancels_prefix": self._prefix("cancels", shard),
            "control_prefix": CONTROL_PREFIX, "events_key": self.job_events(shard),
        }


# --- the worker fleet (register.lua touches all three: one tag) -----------------------------------------------
FLEET = f"{PREFIX}{{fleet}}:"
WORKERS = f"{FLEET}workers"  # zset: worker_id -> last heartbeat (Redis server time)
MODEL_CARDS = f"{FLEET}models"  # hash: served model name -> ModelCard JSON
CONTROL_PREFIX = f"{PREFIX}control:"

# A dead-letter entry and a stale worker entry are pruned after this many seconds.
DEAD_LETTER_KEEP_S = 7 * 86_400
# A worker's WorkerInfo key lives this many lease TTLs past its last heartbeat.
WORKER_INFO_TTL_LEASES = 3
# Idempotency keys of jobs that are still queued or running never expire; at the job's terminal
# transition they get the job's result TTL.


def worker_info(worker_id: str) -> str:
    """String: the worker's latest WorkerInfo JSON, expiring when its heartbeats stop."""
    return f"{FLEET}worker:{worker_id}"


def control(worker_id: str) -> str:
    """Pub/sub channel (PUBLISH, cluster-wide): job ids the worker must abort now (the fast path beside its
    durable cancel sets ``Keyspace.worker_cancels``)."""
    return f"{CONTROL_PREFIX}{worker_id}"


# Fair share, deadlines and rate limits (docs/protocol.md, "Tenants"). A tenant is a job's owner (the hash of its
# API key), or ``-`` for jobs without one.
NO_OWNER_TENANT = "-"


def tenant_of(owner: str | None) -> str:
    """The fair-share tenant (and rate-limit budget) of a job: its owner, or ``-`` without one."""
    return owner or NO_OWNER_TENANT


def idempotency_scope(owner: str | None, key: str) -> str:
    """What an idempotency key is unique within (and routed by): ``<owner or ->:<key>``."""
    return f"{owner or '-'}:{key}"


# An owner's recent-jobs index keeps its newest entries only (older ones are trimmed at each submission).
OWNER_JOBS_KEEP = 500


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
JOB_EVENTS_MAXLEN = 100_000  # entries kept per shard's job-event stream (Keyspace.job_events)
JOB_EVENTS_GROUP = "webhooks"  # the consumer group of the API replicas turning job events into deliveries
# One tag: webhook_enqueue.lua and the delivery transactions touch a delivery and the due/dead sets together.
WEBHOOK_PREFIX = f"{PREFIX}{{webhooks}}:webhook:"
WEBHOOKS_DUE = f"{PREFIX}{{webhooks}}:due"  # zset: message id -> time of its next attempt (Redis time)
WEBHOOKS_DEAD = f"{PREFIX}{{webhooks}}:dead"  # zset: message id -> time it was given up on


def webhook(message_id: str) -> str:
    """Hash: one delivery (url, payload, event type, attempts, first/last attempt, last error)."""
    return f"{WEBHOOK_PREFIX}{message_id}"
