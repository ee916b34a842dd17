"""The shipped Lua scripts and key layout, used as another backend would: plain Redis commands, no JobQueue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from shared import keys
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


def test_raw_eval_of_submit_lua(client: redis.Redis) -> None:
    """EVAL the file as shipped, with the keys and arguments docs/protocol.md gives."""
    script = (LUA_DIR / "submit.lua").read_text()

    def submit(job_id: str, priority: int, idem: str | None = None, cap: int = 10) -> list:
        body = json.dumps({"id": job_id, "model": "m", "prompt": "Hi", "priority": priority})
        job_keys = [f"ts:job:{{{job_id}}}", "ts:queue:{m}", "ts:queue:{m}:seq"]
        if idem:
            job_keys.append(f"ts:idem:-:{idem}")
        return client.eval(script, len(job_keys), *job_keys, body, cap)

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
    assert submit("raw-job-0005", 0, cap=3) == ["full", 3]
    with pytest.raises(redis.ResponseError, match="already exists"):
        submit("raw-job-0001", 0)
    with pytest.raises(redis.ResponseError, match="priority"):
        submit("raw-job-0006", 5000)
