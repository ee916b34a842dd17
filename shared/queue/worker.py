"""The job queue, the worker's side: register, claim under a lease and a fence, renew, publish events, complete,
fail or release jobs, hear cancellations and wake-ups, and reap expired leases (the API's reaper does too)."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import Any

from redis.exceptions import NoScriptError

from shared import keys
from shared.lifecycle_log import RECOVERIES, job_fields
from shared.pubsub import as_text, listen
from shared.queue.base import ClaimedJob, QueueBase, RecoveredJob, invalid_reason, priority_of_score
from shared.schemas import (
    JobResult,
    JobStatus,
    JobSubmission,
    ModelCard,
    RestartEvent,
    TokenEvent,
    WorkerInfo,
)

log = logging.getLogger(__name__)

REAP_BATCH = 100
# Jobs in one publish_step.lua call at most: a script blocks Redis while it runs (~10 us per job and event), so a
# step of thousands of jobs is split into calls of a few milliseconds each, letting other clients in between.
PUBLISH_STEP_MAX_JOBS = 256


def publish_groups(job_ids: Sequence[str], keyspace: keys.Keyspace, max_jobs: int = PUBLISH_STEP_MAX_JOBS
                   ) -> list[tuple[int, list[int]]]:
    """How one step's jobs are split into publish_step.lua calls: ``(shard, indexes into job_ids)`` per call.

    A script's keys must share a hash slot, so each call holds jobs of one queue shard (their keys carry its
    tag), at most ``max_jobs`` of them, in step order within the shard.
    """
    if max_jobs < 1:
        raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
    by_shard: dict[int, list[int]] = {}
    for i, job_id in enumerate(job_ids):
        by_shard.setdefault(keyspace.shard_of(job_id), []).append(i)
    return [(shard, indexes[start:start + max_jobs]) for shard, indexes in sorted(by_shard.items())
            for start in range(0, len(indexes), max_jobs)]


class WorkerSide(QueueBase):
    """Worker operations of the job protocol; every write carries the claim's fence."""

    async def register_worker(self, info: WorkerInfo, card: ModelCard) -> None:
        """Heartbeat: (re)register the worker, and publish its model card and the script config the first time
        (the card holds the tokenizer, megabytes, so later heartbeats do not resend it) and whenever Redis lost
        the card (a restart without persistence)."""
        info_ttl = max(1, math.ceil(self._settings.lease_ttl_s * keys.WORKER_INFO_TTL_LEASES))
        send_card = info.id not in self._cards_sent or not await self._redis.hexists(keys.MODEL_CARDS, card.name)
        await self._scripts.register(
            keys=[keys.WORKERS, keys.worker_info(info.id), keys.MODEL_CARDS],
            args=[info.id, info.model_dump_json(), info_ttl, card.name, card.model_dump_json() if send_card else "",
                  keys.DEAD_LETTER_KEEP_S],
        )
        if send_card:
            await self.publish_config(replace=False)
        self._cards_sent.add(info.id)

    async def deregister_worker(self, worker_id: str) -> None:
        """The worker leaves cleanly (its jobs must have been completed or released first)."""
        await self._scripts.deregister(keys=[keys.WORKERS, keys.worker_info(worker_id)], args=[worker_id])
        self._cards_sent.discard(worker_id)

    async def claim(self, model: str, worker_id: str, max_jobs: int, idle: bool = True) -> list[ClaimedJob]:
        """Take up to ``max_jobs`` jobs of ``model``, best priority first, under a lease of ``lease_ttl_s``.

        ``idle``: the worker holds no job. Only an idle worker is handed an isolated job (then alone); a busy one
        claims nothing behind an isolated job at the head of the queue, so it drains and can take it next.

        A job whose stored submission is not a valid JobSubmission for this queue fails at once with the
        validation error and is not returned; the caller never sees malformed jobs.
        """
        jobs, _ = await self.claim_and_expire(model, worker_id, max_jobs, idle)
        return jobs

    async def claim_and_expire(self, model: str, worker_id: str, max_jobs: int, idle: bool = True
                               ) -> tuple[list[ClaimedJob], int]:
        """``claim``, and how many queued jobs of ``model`` the claim found past their start-by time and
        finalised ``expired`` first (claim.lua)."""
        claimed: list[ClaimedJob] = []
        num_expired = 0
        for shard, lowest in await self._claim_order(model):
            if len(claimed) >= max_jobs or any(job.alone for job in claimed):
                break
            jobs, expired = await self._claim_shard(model, shard, worker_id, max_jobs - len(claimed),
                                                    idle and not claimed, lowest)
            claimed += jobs
            num_expired += expired
        return claimed, num_expired

    async def _claim_order(self, model: str) -> list[tuple[int, int | None]]:
        """The shards to claim from, in order, each with the lowest priority to take there: best head priority
        first (ties rotate, so no shard starves), and in each shard nothing below the best priority waiting at the
        head of a shard later in the order. One shard: no look first."""
        ks = self.keyspace
        if ks.num_shards == 1:
            return [(0, None)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for shard in ks.shards:
                pipe.zrange(ks.queue(model, shard), 0, 0, withscores=True)
            heads = await pipe.execute()
        self._claim_turn = (self._claim_turn + 1) % ks.num_shards
        waiting = [(priority_of_score(float(head[0][1])), (shard - self._claim_turn) % ks.num_shards, shard)
                   for shard, head in enumerate(heads) if head]
        waiting.sort(key=lambda w: (-w[0], w[1]))
        return [(shard, max((w[0] for w in waiting[i + 1:]), default=None)) for i, (_, _, shard) in enumerate(waiting)]

    async def _claim_shard(self, model: str, shard: int, worker_id: str, max_jobs: int, idle: bool,
                           lowest: int | None) -> tuple[list[ClaimedJob], int]:
        ks = self.keyspace
        reply = await self._scripts.claim(
            keys=[ks.queue(model, shard), ks.inflight(shard), ks.queue_tenants(model, shard),
                  ks.queue_vtime(model, shard), ks.queue_deadlines(model, shard)],
            args=[self._ctx[shard], worker_id, max_jobs, int(idle), "" if lowest is None else lowest])
        num_expired = int(reply[0])
        claimed = []
        for raw_id, raw_sub, fence, attempt, alone, time_left in reply[1:]:
            job_id = as_text(raw_id)
            try:
                submission = JobSubmission.model_validate_json(raw_sub)
                if submission.id != job_id or submission.model != model:
                    raise ValueError(f"submission id/model ({submission.id}, {submission.model}) do not match "
                                     f"its record ({job_id}) and queue ({model})")
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                reason = invalid_reason(exc)
                log.warning("job %s is malformed, failing it: %s", job_id, reason, extra={"job_id": job_id})
                await self.fail(job_id, int(fence), f"invalid job: {reason}")
                continue
            left = as_text(time_left)
            claimed.append(ClaimedJob(submission, int(fence), int(attempt), alone=int(alone) == 1,
                                      time_left_s=float(left) if left else None))
        return claimed, num_expired

    async def renew(self, worker_id: str, fences: dict[str, int]) -> list[str]:
        """Extend the leases of the worker's jobs; returns the ids whose lease was lost (abort those)."""
        if not fences:
            return []
        ks = self.keyspace
        lost: list[str] = []
        for shard in ks.shards:
            args: list[str | int] = [self._ctx[shard], worker_id]
            for job_id, fence in fences.items():
                if ks.shard_of(job_id) == shard:
                    args += [job_id, fence]
            if len(args) > 2:
                lost += [as_text(x) for x in await self._scripts.renew(keys=[ks.inflight(shard)], args=args)]
        return lost

    async def publish_many(self, batches: Iterable[tuple[str, int, Sequence[TokenEvent | RestartEvent]]],
                           ) -> list[bool]:
        """``publish`` for several jobs in one round trip: one engine step's events, in one publish_step.lua call
        per group of ``publish_groups`` (one group of up to ``PUBLISH_STEP_MAX_JOBS`` jobs on a single node).
        Returns, per job in order, whether it was published (False: stale fence, the worker lost the job).

        Each event's ``seq`` is its number within this claim (1, 2, ... per attempt, gap-free); Redis renumbers
        it with the job's own counter, so seq keeps growing across attempts, and drops numbers it already
        has, so a retried call never duplicates an event.
        """
        jobs = list(batches)
        calls: list[tuple[list[str], list[str | int]]] = []
        order: list[int] = []
        for shard, group in publish_groups([job_id for job_id, _, _ in jobs], self.keyspace):
            job_keys: list[str] = []
            args: list[str | int] = [self._ctx[shard]]
            order += group
            for job_id, fence, events in (jobs[i] for i in group):
                job_keys.append(self.keyspace.job(job_id))
                args += [job_id, fence, int(any(isinstance(e, TokenEvent) for e in events)), len(events)]
                for event in events:
                    args += [event.seq, event.model_dump_json(exclude={"seq"})]
            calls.append((job_keys, args))
        try:
            replies = await self._publish_pipeline(calls)
        except NoScriptError:  # Redis restarted (or a replica took over) without its scripts: load it (on every
            # master of a cluster) and send again; a call that did run skips the events it already published
            await self._redis.script_load(self._scripts.publish_step.script)
            replies = await self._publish_pipeline(calls)
        published = [False] * len(jobs)
        for i, ok in zip(order, (ok for reply in replies for ok in reply), strict=True):
            published[i] = bool(int(ok))
        return published

    async def _publish_pipeline(self, calls: Sequence[tuple[list[str], list[str | int]]]) -> list[Any]:
        """EVALSHA of publish_step.lua per group in one pipeline. Called directly rather than as registered
        scripts, which would make every pipeline ask ``SCRIPT EXISTS`` first: one round trip per step saved."""
        sha = self._scripts.publish_step.sha
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_keys, args in calls:
                # execute_command: a cluster pipeline refuses .evalsha(), but routes a raw EVALSHA by its keys.
                pipe.execute_command("EVALSHA", sha, len(job_keys), *job_keys, *args)
            return list(await pipe.execute())

    async def complete(self, job_id: str, fence: int, result: JobResult) -> bool:
        """Write the result with the final status: ``cancelled`` if any choice was aborted (a cancel),
        ``expired`` if any stopped at the job's timeout, else ``succeeded``. The tokens used settle the job's
        rate-limit reservation and fair-share charge. False: stale fence, rejected."""
        reasons = {c.finish_reason for c in result.choices}
        status = (JobStatus.CANCELLED if "abort" in reasons else
                  JobStatus.EXPIRED if "timeout" in reasons else JobStatus.SUCCEEDED)
        used = result.usage.prompt_tokens + result.usage.completion_tokens
        shard = self.keyspace.shard_of(job_id)
        ok = await self._scripts.complete(keys=[self.keyspace.job(job_id), self.keyspace.inflight(shard)],
                                          args=[self._ctx[shard], job_id, fence, status.value, result.model_dump_json(),
                                                used])
        return bool(int(ok))

    async def fail(self, job_id: str, fence: int, error: str) -> bool:
        """Fail the job for good with ``error`` (no retry). False: stale fence, rejected."""
        ks, shard = self.keyspace, self.keyspace.shard_of(job_id)
        ok = await self._scripts.fail(keys=[ks.job(job_id), ks.inflight(shard)],
                                      args=[self._ctx[shard], job_id, fence, error])
        return bool(int(ok))

    async def release(self, job_id: str, fence: int, crashed: bool) -> str | None:
        """Give a running job back to its queue at its priority (a restart event tells its readers): after its
        engine crashed (``crashed``: charged if it ran alone, else isolated; docs/protocol.md) or in a drain (not
        charged). Returns the job's new status (``queued``; ``failed`` when dead-lettered; ``cancelled`` when a
        cancel was pending), or None for a stale fence."""
        ks, shard = self.keyspace, self.keyspace.shard_of(job_id)
        reply = await self._scripts.release(keys=[ks.job(job_id), ks.inflight(shard), ks.dead_letter(shard)],
                                            args=[self._ctx[shard], job_id, fence, int(crashed)])
        status = as_text(reply)
        return None if status == "0" else status

    def cancellations(self, worker_id: str) -> AsyncGenerator[str, None]:
        """Job ids the worker must abort: live from its control channel, and every ``poll_interval_s`` again
        from its durable cancel set (so a message missed during a reconnect is not lost). An id may repeat
        until the worker finalises the job."""
        async def pending() -> list[str]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for shard in self.keyspace.shards:
                    pipe.smembers(self.keyspace.worker_cancels(worker_id, shard))
                return [as_text(job_id) for ids in await pipe.execute() for job_id in ids]

        return listen(self._redis, [keys.control(worker_id)], pending, f"control channel of {worker_id}",
                      self._poll_s)

    def wakeups(self, model: str) -> AsyncGenerator[str, None]:
        """A job id each time one enters the model's queue (submitted or requeued), from its wake channel; an
        empty string after every (re)connect and every quiet ``poll_interval_s``, when one may have been missed.
        Many idle workers may wake for one job: they race to claim it and the losers find nothing."""
        async def maybe_missed() -> list[str]:
            return [""]

        channels = [self.keyspace.queue_wake(model, shard) for shard in self.keyspace.shards]
        return listen(self._redis, channels, maybe_missed, f"wake channels of {model}", self._poll_s)

    async def reap(self) -> list[RecoveredJob]:
        """Recover jobs whose lease expired (a crash, docs/protocol.md): requeued, or failed and dead-lettered,
        or cancelled; tells which jobs went where (for metrics) and logs one line per job."""
        recovered: list[RecoveredJob] = []
        for shard in self.keyspace.shards:
            recovered += await self._reap_shard(shard)
        return recovered

    async def _reap_shard(self, shard: int) -> list[RecoveredJob]:
        recovered: list[RecoveredJob] = []
        while True:
            reply = await self._scripts.reap(keys=[self.keyspace.inflight(shard), self.keyspace.dead_letter(shard)],
                                             args=[self._ctx[shard], REAP_BATCH])
            for raw_id, model, worker_id, status in reply[1:]:
                job = RecoveredJob(as_text(raw_id), as_text(model), as_text(worker_id) or None, as_text(status))
                log.warning("job %s: lease of worker %s expired; job %s", job.job_id, job.worker_id, job.status,
                            extra=job_fields(RECOVERIES[job.status].by_reaper, job.job_id, job.model, job.worker_id))
                recovered.append(job)
            if int(reply[0]) < REAP_BATCH:
                return recovered
