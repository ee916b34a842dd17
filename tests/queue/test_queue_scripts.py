"""The shipped Lua scripts and key layout, used as another backend would: plain Redis commands, no JobQueue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.config import Settings
from shared.queue.base import script_config
from shared.scripts import Scripts, lua_source, script_source

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

LUA_DIR = Path(__file__).resolve().parents[2] / "shared" / "lua"


@pytest.fixture()
def client(redis_url: str) -> redis.Redis:
    with redis.Redis.from_url(redis_url, decode_responses=True) as c:
        yield c


def test_every_transition_script_compiles_in_redis(client: redis.Redis) -> None:
    for name in Scripts.__dataclass_fields__:
        assert len(client.script_load(script_source(name))) == 40
    assert lua_source("submit") == (LUA_DIR / "submit.lua").read_text()


def test_the_keys_of_a_job_and_its_shard_share_the_shards_hash_tag() -> None:
    three = keys.Keyspace(3)
    assert len(set(three.tags)) == 3 and [keys.crc16(tag) % keys.SLOTS * 3 // keys.SLOTS for tag in three.tags] == [
        0, 1, 2]  # each shard in its own third of the slots: one per master of a 3-master cluster
    for job_id in ("Zx8_-kq1AbCdEf", "job-0001", "x" * 64):
        tag = three.tags[three.shard_of(job_id)]
        for key in (three.job(job_id), three.job_log(job_id), three.job_live(job_id)):
            assert key[key.index("{") + 1 : key.index("}")] == tag
    for key in (three.queue("m", 2), three.queue_seq("m", 2), three.inflight(2), three.config(2),
                three.idempotency(None, "k", 2), three.owner_jobs("o", 2), three.job_events(2),
                three.worker_cancels("w", 2), three.queue_rate("m", "t", 2)):
        assert key[key.index("{") + 1 : key.index("}")] == three.tags[2]


def test_job_ids_are_made_in_the_shard_their_submission_goes_to() -> None:
    three = keys.Keyspace(3)
    scope_shard = three.shard_of(keys.idempotency_scope("o", "k"))
    assert three.shard_of(three.job_id_for("o", "k", rate_limited=False)) == scope_shard
    assert three.shard_of(three.job_id_for("o", None, rate_limited=True)) == three.shard_of("o")
    fitted = three.job_id_for("o", None, rate_limited=True, base="batch_x-7")
    assert fitted == three.job_id_for("o", None, rate_limited=True, base="batch_x-7")  # deterministic
    assert fitted.startswith("batch_x-7") and three.shard_of(fitted) == three.shard_of("o")


def _store_config(client: redis.Redis, **settings: object) -> None:
    """What every API and worker stores at start (``QueueBase.publish_config``)."""
    config = script_config(Settings(**settings), KS, 0)  # type: ignore[arg-type]
    client.hset(KS.config(0), mapping={k: str(v) for k, v in config.items()})


def test_raw_eval_of_submit_lua(client: redis.Redis) -> None:
    """EVAL the file as shipped, with the keys and the one argument docs/protocol.md gives."""
    script = (LUA_DIR / "submit.lua").read_text()

    def submit(job_id: str, priority: int, idem: str | None = None) -> list:
        body = json.dumps({"id": job_id, "model": "m", "prompt": "Hi", "priority": priority,
                           **({"idempotency_key": idem} if idem else {})})
        job_keys = [f"ts:job:{{0}}:{job_id}", "ts:queue:{0}:m", "ts:queue:{0}:m:seq", "ts:config:{0}"]
        if idem:
            job_keys.append(f"ts:idem:{{0}}:-:{idem}")
        return client.eval(script, len(job_keys), *job_keys, body)

    with pytest.raises(redis.ResponseError, match=r"ts:config:\{0\} is missing: start the tokenspool API or a worker"):
        submit("raw-job-0001", 0)
    _store_config(client, max_queue_length=3)
    reply = submit("raw-job-0001", 0)
    assert reply[0] == "created"
    fields = dict(zip(reply[1][::2], reply[1][1::2], strict=True))
    assert fields["status"] == "queued" and fields["attempts"] == "0" and float(fields["created_at"]) > 0
    submit("raw-job-0002", 7)
    assert submit("raw-job-0003", 0, idem="k")[0] == "created"
    again = submit("raw-job-0004", 0, idem="k")
    assert again[0] == "existing" and dict(zip(again[1][::2], again[1][1::2], strict=True))["id"] == "raw-job-0003"

    # Highest priority first, then FIFO: exact integer scores -priority * 2^32 + seq.
    assert client.zrange("ts:queue:{0}:m", 0, -1, withscores=True) == [
        ("raw-job-0002", -7 * 2**32 + 2), ("raw-job-0001", 1.0), ("raw-job-0003", 3.0)]
    assert submit("raw-job-0005", 0) == ["full", 3]  # the cap is the service's max_queue_length, from ts:config
    with pytest.raises(redis.ResponseError, match="already exists"):
        submit("raw-job-0001", 0)
    with pytest.raises(redis.ResponseError, match="priority"):
        submit("raw-job-0006", 5000)


_JOB, _QUEUE, _SEQ, _CONFIG = "ts:job:{0}:raw-job-0001", "ts:queue:{0}:m", "ts:queue:{0}:m:seq", "ts:config:{0}"


@pytest.mark.parametrize(("body", "job_keys", "error"), [
    ({"id": "short"}, ["ts:job:{0}:short", _QUEUE, _SEQ, _CONFIG], "id must be 8-64 characters"),
    ({"id": "job/00000001"}, ["ts:job:{0}:job/00000001", _QUEUE, _SEQ, _CONFIG], "id must be 8-64 characters"),
    ({}, ["ts:job:{0}:other-job-001", _QUEUE, _SEQ, _CONFIG], r"KEYS\[1\] must be ts:job:\{0\}:raw-job-0001"),
    ({}, [_JOB, "ts:queue:{0}:n", _SEQ, _CONFIG], r"KEYS\[2\] must be ts:queue:\{0\}:m"),
    ({}, [_JOB, _QUEUE, "ts:queue:{0}:m:n", _CONFIG], r"KEYS\[3\] must be ts:queue:\{0\}:m:seq"),
    ({"idempotency_key": "k"}, [_JOB, _QUEUE, _SEQ, _CONFIG], r"KEYS\[5\] must be ts:idem:\{0\}:-:k"),
    ({"idempotency_key": "k", "owner": "o"}, [_JOB, _QUEUE, _SEQ, _CONFIG, "ts:idem:{0}:-:k"],
     r"KEYS\[5\] must be ts:idem:\{0\}:o:k"),
    ({}, [_JOB, _QUEUE, _SEQ, _CONFIG, "ts:idem:{0}:-:k"],
     r"KEYS\[5\] given but the submission has no idempotency_key"),
])
def test_submit_lua_refuses_keys_that_do_not_match_the_submission(client: redis.Redis, body: dict, job_keys: list,
                                                                  error: str) -> None:
    """The key names follow from the submission and the stored layout: a producer cannot put a job in another
    model's queue, nor use an idempotency key other than the one its JSON names."""
    _store_config(client)
    submission = json.dumps({"id": "raw-job-0001", "model": "m", "prompt": "Hi", **body})
    with pytest.raises(redis.ResponseError, match=error):
        client.eval((LUA_DIR / "submit.lua").read_text(), len(job_keys), *job_keys, submission)
    assert client.exists(_JOB, _QUEUE, "ts:job:{0}:short") == 0


def test_raw_eval_of_cancel_needs_only_the_job_id(client: redis.Redis) -> None:
    """lib.lua + cancel.lua with the record, the in-flight set and ts:config: no copy of any setting."""
    _store_config(client, result_ttl_s=1234)
    body = json.dumps({"id": "raw-job-0001", "model": "m", "prompt": "Hi"})
    client.eval(lua_source("submit"), 4, "ts:job:{0}:raw-job-0001", "ts:queue:{0}:m", "ts:queue:{0}:m:seq",
                "ts:config:{0}", body)
    cancel = lua_source("lib") + "\n" + lua_source("cancel")
    fields = client.eval(cancel, 3, "ts:job:{0}:raw-job-0001", "ts:inflight:{0}", "ts:config:{0}", "raw-job-0001")
    assert dict(zip(fields[::2], fields[1::2], strict=True))["status"] == "cancelled"
    assert 1200 < client.ttl("ts:job:{0}:raw-job-0001") <= 1234  # the service's result TTL, from ts:config
    assert client.zcard("ts:queue:{0}:m") == 0
    assert client.eval(cancel, 3, "ts:job:{0}:no-such-job", "ts:inflight:{0}", "ts:config:{0}", "no-such-job") == []
    with pytest.raises(redis.ResponseError, match=r"KEYS\[1\] must be ts:job:\{0\}:raw-job-0001"):
        client.eval(cancel, 3, "ts:job:{0}:x", "ts:inflight:{0}", "ts:config:{0}", "raw-job-0001")


def test_submit_lua_checks_the_shard_with_the_same_crc16_as_python(client: redis.Redis) -> None:
    """Three shards: submit.lua (its own CRC16 in Lua) takes every id, idempotency scope (non-ASCII too) and
    rate-limited tenant that Python's CRC16 puts in the keys' shard, and refuses each one it puts elsewhere."""
    three = keys.Keyspace(3)
    for shard in three.shards:
        config = script_config(Settings(), three, shard)
        client.hset(three.config(shard), mapping={k: str(v) for k, v in config.items()})

    def submit(job_id: str, shard: int, **fields: str) -> list:
        body = json.dumps({"id": job_id, "model": "m", "prompt": "Hi", **fields})
        job_keys = [three.job(job_id).replace(f"{{{three.tags[three.shard_of(job_id)]}}}", f"{{{three.tags[shard]}}}"),
                    three.queue("m", shard), three.queue_seq("m", shard), three.config(shard)]
        if "idempotency_key" in fields:
            job_keys.append(three.idempotency(fields.get("owner"), fields["idempotency_key"], shard))
        return client.eval(lua_source("submit"), len(job_keys), *job_keys, body)

    for n in range(12):
        job_id = f"crc-check-{n:04d}"
        home = three.shard_of(job_id)
        assert submit(job_id, home)[0] == "created"
        with pytest.raises(redis.ResponseError, match=f"job id {job_id} maps to shard {home}, not to shard"):
            submit(f"{job_id}", (home + 1) % 3)
    scope_key = "clé-ü-7"
    scope_shard = three.shard_of(keys.idempotency_scope(None, scope_key))
    job_id = three.job_id_for(None, scope_key, rate_limited=False)
    assert submit(job_id, scope_shard, idempotency_key=scope_key)[0] == "created"
    wrong = next(f"scope-{n:04d}" for n in range(100) if three.shard_of(f"scope-{n:04d}") != scope_shard)
    with pytest.raises(redis.ResponseError, match="idempotency scope .* maps to shard"):
        submit(wrong, three.shard_of(wrong), idempotency_key=scope_key)
    # A tenant with rate limits (KEYS[10] given): its jobs go to the tenant's shard, whatever the id's own.
    tenant_shard = three.shard_of("tenant-a")
    limited = three.job_id_for("tenant-a", None, rate_limited=True)
    rate_keys = [three.job(limited), three.queue("m", tenant_shard), three.queue_seq("m", tenant_shard),
                 three.config(tenant_shard), *[three.job(limited)] * 5, three.queue_rate("m", "tenant-a", tenant_shard)]
    body = json.dumps({"id": limited, "model": "m", "prompt": "Hi", "owner": "tenant-a"})
    assert client.eval(lua_source("submit"), len(rate_keys), *rate_keys, body, 1, '{"rpm": 10}')[0] == "created"
    off = next(f"tenant-job-{n:03d}" for n in range(100) if three.shard_of(f"tenant-job-{n:03d}") != tenant_shard)
    shard = three.shard_of(off)
    rate_keys = [three.job(off), three.queue("m", shard), three.queue_seq("m", shard), three.config(shard),
                 *[three.job(off)] * 5, three.queue_rate("m", "tenant-a", shard)]
    body = json.dumps({"id": off, "model": "m", "prompt": "Hi", "owner": "tenant-a"})
    with pytest.raises(redis.ResponseError, match="tenant .* maps to shard"):
        client.eval(lua_source("submit"), len(rate_keys), *rate_keys, body, 1, '{"rpm": 10}')
