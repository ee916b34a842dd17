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

LUA_DIR = Path(__file__).resolve().parents[2] / "shared" / "lua"


@pytest.fixture()
def client(redis_url: str) -> redis.Redis:
    with redis.Redis.from_url(redis_url, decode_responses=True) as c:
        yield c


def test_every_transition_script_compiles_in_redis(client: redis.Redis) -> None:
    for name in Scripts.__dataclass_fields__:
        assert len(client.script_load(script_source(name))) == 40
    assert lua_source("submit") == (LUA_DIR / "submit.lua").read_text()


def test_keys_of_one_job_share_its_hash_tag() -> None:
    job_id = "Zx8_-kq1AbCdEf"
    for key in (keys.job(job_id), keys.job_log(job_id), keys.job_live(job_id)):
        assert key[key.index("{") + 1 : key.index("}")] == job_id
    assert keys.queue("m")[keys.queue("m").index("{") :].startswith("{m}")
    assert keys.queue_seq("m")[keys.queue_seq("m").index("{") :].startswith("{m}")


def _store_config(client: redis.Redis, **settings: object) -> None:
    """What every API and worker stores at start (``QueueBase.publish_config``)."""
    config = script_config(Settings(**settings))  # type: ignore[arg-type]
    client.hset(keys.CONFIG, mapping={k: str(v) for k, v in config.items()})


def test_raw_eval_of_submit_lua(client: redis.Redis) -> None:
    """EVAL the file as shipped, with the keys and the one argument docs/protocol.md gives."""
    script = (LUA_DIR / "submit.lua").read_text()

    def submit(job_id: str, priority: int, idem: str | None = None) -> list:
        body = json.dumps({"id": job_id, "model": "m", "prompt": "Hi", "priority": priority,
                           **({"idempotency_key": idem} if idem else {})})
        job_keys = [f"ts:job:{{{job_id}}}", "ts:queue:{m}", "ts:queue:{m}:seq", "ts:config"]
        if idem:
            job_keys.append(f"ts:idem:-:{idem}")
        return client.eval(script, len(job_keys), *job_keys, body)

    with pytest.raises(redis.ResponseError, match="ts:config is missing: start the tokenspool API or a worker"):
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
    assert client.zrange("ts:queue:{m}", 0, -1, withscores=True) == [
        ("raw-job-0002", -7 * 2**32 + 2), ("raw-job-0001", 1.0), ("raw-job-0003", 3.0)]
    assert submit("raw-job-0005", 0) == ["full", 3]  # the cap is the service's max_queue_length, from ts:config
    with pytest.raises(redis.ResponseError, match="already exists"):
        submit("raw-job-0001", 0)
    with pytest.raises(redis.ResponseError, match="priority"):
        submit("raw-job-0006", 5000)


_JOB, _QUEUE, _SEQ, _CONFIG = "ts:job:{raw-job-0001}", "ts:queue:{m}", "ts:queue:{m}:seq", "ts:config"


@pytest.mark.parametrize(("body", "job_keys", "error"), [
    ({"id": "short"}, ["ts:job:{short}", _QUEUE, _SEQ, _CONFIG], "id must be 8-64 characters"),
    ({"id": "job/00000001"}, ["ts:job:{job/00000001}", _QUEUE, _SEQ, _CONFIG], "id must be 8-64 characters"),
    ({}, ["ts:job:{other-job-001}", _QUEUE, _SEQ, _CONFIG], r"KEYS\[1\] must be ts:job:\{raw-job-0001\}"),
    ({}, [_JOB, "ts:queue:{n}", _SEQ, _CONFIG], r"KEYS\[2\] must be ts:queue:\{m\}"),
    ({}, [_JOB, _QUEUE, "ts:queue:{m}:n", _CONFIG], r"KEYS\[3\] must be ts:queue:\{m\}:seq"),
    ({"idempotency_key": "k"}, [_JOB, _QUEUE, _SEQ, _CONFIG], r"KEYS\[5\] must be ts:idem:-:k"),
    ({"idempotency_key": "k", "owner": "o"}, [_JOB, _QUEUE, _SEQ, _CONFIG, "ts:idem:-:k"],
     r"KEYS\[5\] must be ts:idem:o:k"),
    ({}, [_JOB, _QUEUE, _SEQ, _CONFIG, "ts:idem:-:k"], r"KEYS\[5\] given but the submission has no idempotency_key"),
])
def test_submit_lua_refuses_keys_that_do_not_match_the_submission(client: redis.Redis, body: dict, job_keys: list,
                                                                  error: str) -> None:
    """The key names follow from the submission and the stored layout: a producer cannot put a job in another
    model's queue, nor use an idempotency key other than the one its JSON names."""
    _store_config(client)
    submission = json.dumps({"id": "raw-job-0001", "model": "m", "prompt": "Hi", **body})
    with pytest.raises(redis.ResponseError, match=error):
        client.eval((LUA_DIR / "submit.lua").read_text(), len(job_keys), *job_keys, submission)
    assert client.exists(_JOB, _QUEUE, "ts:job:{short}") == 0


def test_raw_eval_of_cancel_needs_only_the_job_id(client: redis.Redis) -> None:
    """lib.lua + cancel.lua with the record, the in-flight set and ts:config: no copy of any setting."""
    _store_config(client, result_ttl_s=1234)
    body = json.dumps({"id": "raw-job-0001", "model": "m", "prompt": "Hi"})
    client.eval(lua_source("submit"), 4, "ts:job:{raw-job-0001}", "ts:queue:{m}", "ts:queue:{m}:seq", "ts:config",
                body)
    cancel = lua_source("lib") + "\n" + lua_source("cancel")
    fields = client.eval(cancel, 3, "ts:job:{raw-job-0001}", "ts:inflight", "ts:config", "raw-job-0001")
    assert dict(zip(fields[::2], fields[1::2], strict=True))["status"] == "cancelled"
    assert 1200 < client.ttl("ts:job:{raw-job-0001}") <= 1234  # the service's result TTL, from ts:config
    assert client.zcard("ts:queue:{m}") == 0
    assert client.eval(cancel, 3, "ts:job:{no-such-job}", "ts:inflight", "ts:config", "no-such-job") == []
    with pytest.raises(redis.ResponseError, match=r"KEYS\[1\] must be ts:job:\{raw-job-0001\}"):
        client.eval(cancel, 3, "ts:job:{x}", "ts:inflight", "ts:config", "raw-job-0001")
