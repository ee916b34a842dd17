"""Jobs pushed straight into Redis with the shipped scripts (docs/protocol.md, "Using it without Python"), as the
API shows them: an invalid one as failed with its error, an owned one only to its API key."""

from __future__ import annotations

import hashlib
import json
import secrets
import time

import redis
from conftest import ApiServer, wait_until

from shared import keys
from shared.scripts import lua_source
from tests.worker.scripted_engine import MODEL, InProcessWorker

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with


def _raw_submit(client: redis.Redis, submission: dict[str, object]) -> None:
    client.eval(lua_source("submit"), 4, KS.job(str(submission["id"])), KS.queue(MODEL, 0), KS.queue_seq(MODEL, 0),
                KS.config(0), json.dumps(submission))


def _redis(api: ApiServer) -> redis.Redis:
    client = redis.Redis.from_url(str(api.settings.redis_url), decode_responses=True)
    wait_until(lambda: client.exists(KS.config(0)), what="the API stored ts:config")
    return client


def test_a_raw_job_that_does_not_validate_is_failed_with_its_error(api: ApiServer, worker: InProcessWorker) -> None:
    job_id = secrets.token_hex(16)
    with _redis(api) as r:
        _raw_submit(r, {"id": job_id, "model": MODEL, "prompt": "hi", "params": {"temperature": "hot"}})
    with api.client() as client:
        deadline = time.monotonic() + 10
        while (record := client.get(f"/v1/jobs/{job_id}")).status_code == 200 and \
                record.json()["status"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.status_code == 200, record.text
        body = record.json()
    assert body["status"] == "failed"
    assert body["error"].startswith("invalid job: params.temperature")


def test_a_raw_jobs_owner_is_the_sha256_of_the_api_key_that_may_see_it(start_api: object) -> None:
    api: ApiServer = start_api(api_keys=["key-a", "key-b"])  # type: ignore[operator]
    job_id = secrets.token_hex(16)
    with _redis(api) as r:
        _raw_submit(r, {"id": job_id, "model": MODEL, "prompt": "hi",
                        "owner": hashlib.sha256(b"key-a").hexdigest()})
        with api.client("key-a") as a, api.client("key-b") as b:
            assert a.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
            assert b.get(f"/v1/jobs/{job_id}").status_code == 404
        # Cancel with the shipped scripts, as another backend would: lib.lua + cancel.lua, the job id only.
        cancel = lua_source("lib") + "\n" + lua_source("cancel")
        fields = r.eval(cancel, 3, KS.job(job_id), KS.inflight(0), KS.config(0), job_id)
        assert dict(zip(fields[::2], fields[1::2], strict=True))["status"] == "cancelled"
        assert 0 < r.ttl(KS.job(job_id)) <= api.settings.result_ttl_s
