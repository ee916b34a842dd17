"""One job's event stream as a reader sees it: the replay log for history and gaps, pub/sub for live delivery.

Each seq comes once and in order, whatever was missed during a reconnect or published between subscribing and
the first replay; the stream ends with the job's DoneEvent, or an ErrorEvent when the job does not exist.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from shared.live_channels import RESYNC, LiveSubscription
from shared.pubsub import TRANSIENT_ERRORS
from shared.schemas import DoneEvent, ErrorEvent, RestartEvent, StreamEvent, TokenEvent

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from shared.queue.client import ClientSide

log = logging.getLogger(__name__)

# The largest event seq there can be: seq is the job hash's HINCRBY counter, a signed 64-bit integer. A reader
# may resume after any seq up to this (a Redis stream id part goes to 2**64 - 1, beyond which XRANGE errors).
MAX_EVENT_SEQ = 2**63 - 1
# A quiet stream re-reads the log after poll_interval_s, then after twice as long each time nothing came, up to
# this many poll intervals: a reconnect already tells readers to resync, so the quiet check only guards against
# the rare lost message, and 10,000 waiting streams must not cost 5,000 log reads a second.
MAX_QUIET_POLLS = 8

STREAM_EVENTS: TypeAdapter[TokenEvent | RestartEvent | DoneEvent | ErrorEvent] = TypeAdapter(StreamEvent)


def entry_event(fields: dict[Any, Any]) -> dict[str, Any]:
    """The event JSON of one replay-log entry (field ``data``), decoded responses or not."""
    event: dict[str, Any] = json.loads(fields[b"data"] if b"data" in fields else fields["data"])
    return event


class JobStreamReader:
    """One reader of one job's events: pub/sub for live delivery (the process's shared connection,
    ``shared.live_channels``), the replay log for history and gaps."""

    def __init__(self, queue: ClientSide, job_id: str, after_seq: int) -> None:
        if not 0 <= after_seq <= MAX_EVENT_SEQ:
            raise ValueError(f"after_seq must be between 0 and {MAX_EVENT_SEQ}, got {after_seq}")
        self._queue = queue
        self._job_id = job_id
        self._last = after_seq
        self._live: LiveSubscription | None = None
        self._more = False  # the last log page read was full: read on before waiting for live events
        self._quiet = 0  # quiet waits in a row (each doubles the next, up to MAX_QUIET_POLLS poll intervals)

    async def subscribe(self) -> None:
        self._live = await self._queue.live_channels.subscribe(self._queue.keyspace.job_live(self._job_id))

    async def close(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            await self._queue.live_channels.release(live)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Replay after ``after_seq``, then live events, each seq once and in order.

        A live message that follows on from the last seq is used as is; an older one is a duplicate of the
        replay and dropped; a newer one means something was missed, and the log fills the gap. After a quiet
        ``poll_interval_s`` (doubling while the stream stays quiet, up to ``MAX_QUIET_POLLS`` of them) or a
        reconnect the log is read again and the job checked, so a finished or expired job never leaves the
        reader waiting. The log is read a page at a time, and the next page only once the
        consumer has taken this one: a slow consumer holds one page, never the whole log.
        """
        pending: list[dict[str, Any]] | None = None  # None: the first replay is still to do
        while True:
            try:
                if pending is None:  # inside the try: Redis may go away between subscribing and this first read
                    pending = await self._replay_or_end()
                for raw in pending:
                    if raw["seq"] <= self._last and not raw.get("again"):
                        continue
                    event = await self._expand(raw)
                    self._last = event.seq
                    yield event
                    if isinstance(event, DoneEvent | ErrorEvent):
                        return
                if self._more:
                    pending = await self._replay()
                elif self._live is None:  # lost in a Redis outage: subscribe again, then catch up from the log
                    await self.subscribe()
                    pending = await self._replay_or_end()
                else:
                    pending = await self._next_live()
            except TRANSIENT_ERRORS as exc:
                log.warning("stream of job %s lost Redis (%s); resubscribing", self._job_id, exc,
                            extra={"job_id": self._job_id})
                await self.close()
                pending = []
                await asyncio.sleep(self._queue.poll_interval_s / 4)

    async def _next_live(self) -> list[dict[str, Any]]:
        """The next events: the live message itself when it follows on, else what the log holds."""
        assert self._live is not None
        data = await self._live.get(self._queue.poll_interval_s * min(2**self._quiet, MAX_QUIET_POLLS))
        self._quiet = self._quiet + 1 if data is None else 0
        if data is None or data is RESYNC:  # quiet, or reconnected: the log has whatever was missed
            return await self._replay_or_end()
        raw: dict[str, Any] = json.loads(data)
        if raw["seq"] <= self._last + 1:
            return [raw]
        return await self._replay()

    async def _replay(self) -> list[dict[str, Any]]:
        """The next page of the log after the last seq seen."""
        entries, self._more = await self._queue.replay_page(self._job_id, self._last)
        return entries

    async def _replay_or_end(self) -> list[dict[str, Any]]:
        """The log after the last seq seen; when it has nothing new, an end the log cannot show, if any."""
        entries = await self._replay()
        if entries:
            return entries
        record = await self._queue.get(self._job_id)
        if record is None:
            return [{"type": "error", "seq": self._last + 1, "message": f"job {self._job_id} not found or expired"}]
        if record.status.is_terminal:
            # It may have finished since the read above: its last events are in the log now, if anywhere.
            entries = await self._replay()
            # Else the log ended at or before ``after_seq`` (a client resuming after the end): end again.
            return entries or [{"type": "done", "seq": max(self._last, 1), "again": True}]
        return []

    async def _expand(self, raw: dict[str, Any]) -> StreamEvent:
        """The log's done marker carries only the status; readers get the full final record."""
        if raw.get("type") == "done":
            record = await self._queue.get(self._job_id)
            if record is None:
                return ErrorEvent(seq=raw["seq"], message=f"job {self._job_id} expired")
            return DoneEvent(seq=raw["seq"], job=record)
        return STREAM_EVENTS.validate_python(raw)
