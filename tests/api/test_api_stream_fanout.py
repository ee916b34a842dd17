"""Many open SSE streams share one Redis pub/sub connection per API process (shared/live_channels.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import redis
from conftest import ApiServer, parse_sse, wait_until

from tests.worker.scripted_engine import expected_text

NUM_STREAMS = 300
MAX_TOKENS = 4


def _pubsub_clients(r: redis.Redis) -> int:
    return sum(1 for c in r.client_list() if "P" in c["flags"])


def _live_channels(r: redis.Redis) -> int:
    return len(r.pubsub_shardchannels("ts:job:*:live"))


async def _stream(client: httpx.AsyncClient, job_id: str) -> str:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        assert response.status_code == 200
        raw = "".join([chunk async for chunk in response.aiter_text()])
    events = parse_sse(raw)
    assert events[-1]["event"] == "done"
    return "".join(json.loads(e["data"])["text"] for e in events if e["event"] == "token")


async def test_hundreds_of_streams_use_one_pubsub_connection(api: ApiServer, start_worker: object) -> None:
    prompts = [f"stream number {i}" for i in range(NUM_STREAMS)]
    with api.client() as client:
        ids = [job["id"] for start in range(0, NUM_STREAMS, 100)
               for job in client.post("/v1/jobs/batch", json={"prompts": prompts[start:start + 100],
                                                              "max_tokens": MAX_TOKENS}).json()["data"]]
    limits = httpx.Limits(max_connections=NUM_STREAMS + 10, max_keepalive_connections=NUM_STREAMS + 10)
    with redis.Redis.from_url(str(api.settings.redis_url)) as r:
        async with httpx.AsyncClient(base_url=api.base_url, timeout=120, limits=limits) as client:
            streams = [asyncio.create_task(_stream(client, job_id)) for job_id in ids]
            await asyncio.to_thread(wait_until, lambda: _live_channels(r) == NUM_STREAMS, 60, "every stream subscribed")
            assert _pubsub_clients(r) == 1  # the API's one connection holds all 300 channels; no worker yet

            start_worker()  # type: ignore[operator]
            texts = await asyncio.wait_for(asyncio.gather(*streams), 120)
        assert texts == [expected_text(p, MAX_TOKENS) for p in prompts]
        await asyncio.to_thread(wait_until, lambda: _live_channels(r) == 0, 10, "every channel unsubscribed")
