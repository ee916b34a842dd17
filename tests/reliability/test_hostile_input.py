"""Hostile input through both doors. Redis: random and malformed jobs pushed as other backends would (EVAL of
the shipped submit.lua, and raw ZADD/HSET of garbage): every one ends cleanly failed (or, when it happens to be
valid, succeeded), and the worker keeps serving. HTTP: bodies and numbers no client should send get a 4xx."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared import keys
from tests.reliability.stack import TERMINAL, ApiProcess, poll, submit
from tests.worker.worker_process import WorkerProcess, wait_config

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow

SUBMIT_LUA = (Path(__file__).resolve().parents[2] / "shared" / "lua" / "submit.lua").read_text()
NUM_FUZZED = 150

# Values of every JSON type and edge, for any field.
ODD_VALUES: list[Any] = [
    None, True, 0, -1, 1.5, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, "", "x", "\x00", "\u0000\u0001",
    "🎉" * 3, "a" * 5000, [], [1], ["a"], [[[]]], {}, {"a": 1}, [-1], [10**30],
]
FIELDS = ["prompt", "prompt_token_ids", "messages", "params", "n", "priority", "idempotency_key", "owner",
          "background", "created_at", "v", "model", "bogus"]
PARAM_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "bogus"]
RAW_TEXTS = ['{"id": "x"', "[]", "null", "1", '"text"', "{}", '{"id": 5, "model": "tiny-rel"}', "\x00\x01",
             '{"id": "%s", "model": "tiny-rel", "prompt": "NaN", "params": {"temperature": NaN}}',
             '{"id": "%s", "model": "tiny-rel", "prompt": "big", "params": {"max_tokens": 1e999}}',
             '{"id": "%s", "model": "tiny-rel", "prompt": "\\ud800 lone surrogate", "params": {"max_tokens": 2}}',
             '{"id": "%s", "model": "tiny-rel", "prompt": "deep", "params": ' + "[" * 500 + "]" * 500 + "}"]


def fuzzed_submission(rng: random.Random, job_id: str) -> str | bytes:
    """A job payload: mostly a valid one with a few fields replaced by odd values, sometimes not JSON at all."""
    roll = rng.random()
    if roll < 0.15:
        text = rng.choice(RAW_TEXTS)
        return text % job_id if "%s" in text else text
    if roll < 0.2:  # invalid UTF-8 inside a JSON string
        return b'{"id": "' + job_id.encode() + b'", "model": "tiny-rel", "prompt": "\xff\xfe\xc3"}'
    body: dict[str, Any] = {"id": job_id, "model": "tiny-rel", "prompt": "Hello", "params": {"max_tokens": 2}}
    for field in rng.sample(FIELDS, rng.randint(1, 3)):
        body[field] = rng.choice(ODD_VALUES)
    if isinstance(body.get("params"), dict):
        for field in rng.sample(PARAM_FIELDS, rng.randint(0, 3)):
            body["params"][field] = rng.choice(ODD_VALUES)
    return json.dumps(body)


def push_garbage_records(r: redis.Redis) -> list[str]:
    """Queue entries written by hand (ZADD/HSET), not by submit.lua. Returns the ids that have a record."""
    queue = KS.queue("tiny-rel", 0)
    with_record = []
    for name in ["", " ", "{x}", "no-record-at-all", "ü" * 40, "z" * 3000]:
        r.zadd(queue, {name: -1})  # queue entries without a job record
    garbage: dict[str, dict[str, Any]] = {
        "only-status-1": {"status": "queued"},
        "bad-json-0001": {"status": "queued", "submission": "{not json", "id": "bad-json-0001", "model": "tiny-rel"},
        "binary-00001": {"status": "queued", "submission": b"\xff\x00\xfe", "model": "tiny-rel"},
        "not-queued-01": {"status": "running", "submission": "{}"},
        "odd-status-01": {"status": "🎉", "submission": "{}"},
        "bad-fence-001": {"status": "queued", "fence": "abc", "attempts": "x", "seq": "?", "model": "tiny-rel",
                          "score": "nan", "submission": json.dumps({"id": "bad-fence-001", "model": "tiny-rel",
                                                                    "prompt": "x"})},
    }
    for job_id, fields in garbage.items():
        r.hset(KS.job(job_id), mapping=fields)
        r.zadd(queue, {job_id: -1})
        if fields["status"] == "queued":
            with_record.append(job_id)
    r.set(KS.job("wrong-type-01"), "a string where a hash belongs")
    r.zadd(queue, {"wrong-type-01": -1})
    for job_id in ["short", "has space in id", "ünïcödé-id"]:  # ids the protocol does not allow
        r.hset(KS.job(job_id), mapping={"status": "queued", "submission": "{}"})
        r.zadd(queue, {job_id: -1})
        with_record.append(job_id)
    binary_key = KS.job("\x00").encode().replace(b"\x00", b"\xff\xfe-binary-id")
    r.hset(binary_key, mapping={"status": "queued", "submission": "{}"})
    r.zadd(queue, {b"\xff\xfe-binary-id": -1})
    return with_record


def wait_terminal(r: redis.Redis, job_ids: list[str], worker: WorkerProcess, timeout_s: float = 90) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {job_id: (r.hget(KS.job(job_id), "status") or b"").decode() for job_id in job_ids}
        if all(s in TERMINAL for s in statuses.values()):
            return statuses
        assert worker.proc is not None and worker.proc.poll() is None, f"the worker died:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, {k: v for k, v in statuses.items() if v not in TERMINAL}
        time.sleep(0.1)


def wait_drained(r: redis.Redis, worker: WorkerProcess, timeout_s: float = 30) -> None:
    """Until the queue and the in-flight set are empty."""
    deadline = time.monotonic() + timeout_s
    while r.zcard(KS.queue("tiny-rel", 0)) or r.zcard(KS.inflight(0)):
        assert worker.proc is not None and worker.proc.poll() is None, f"the worker died:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, (r.zrange(KS.queue("tiny-rel", 0), 0, -1), r.zrange(KS.inflight(0), 0, -1))
        time.sleep(0.1)


def test_garbage_pushed_into_redis_fails_cleanly_and_the_worker_keeps_serving(
        standing_worker: WorkerProcess, redis_url: str) -> None:
    rng = random.Random(20251129)
    created, refused = [], 0
    with redis.Redis.from_url(redis_url) as r:
        wait_config(r)  # the test's Redis was just flushed
        for _ in range(NUM_FUZZED):
            job_id = secrets.token_urlsafe(12)
            job_keys = [KS.job(job_id), KS.queue("tiny-rel", 0), KS.queue_seq("tiny-rel", 0), KS.config(0)]
            try:
                reply = r.eval(SUBMIT_LUA, 4, *job_keys, fuzzed_submission(rng, job_id))
            except redis.ResponseError:
                refused += 1  # submit.lua's own checks (not a JSON object, no string id, bad id or priority, keys)
                continue
            assert reply[0] == b"created"
            created.append(job_id)
        hand_made = push_garbage_records(r)

        statuses = wait_terminal(r, created + hand_made, standing_worker)
        errors = {job_id: (r.hget(KS.job(job_id), "error") or b"").decode() for job_id in statuses}
        # The record-less entries and the binary id sort after every waited-for job: the worker drops them next.
        wait_drained(r, standing_worker)
        assert r.hget(KS.job("\x00").encode().replace(b"\x00", b"\xff\xfe-binary-id"), "status") == b"failed"

    assert refused > 5 and len(created) > 50
    failed = [job_id for job_id, status in statuses.items() if status == "failed"]
    assert len(failed) > len(statuses) // 2
    assert all(errors[job_id].startswith("invalid job") for job_id in failed), {j: errors[j] for j in failed}
    assert set(statuses.values()) <= {"failed", "succeeded"}

    # Still serving: a valid job pushed the same way runs to the end.
    with redis.Redis.from_url(redis_url) as r:
        job_id = secrets.token_urlsafe(12)
        body = json.dumps({"id": job_id, "model": "tiny-rel", "prompt": "Still here?", "params": {"max_tokens": 5}})
        r.eval(SUBMIT_LUA, 4, KS.job(job_id), KS.queue("tiny-rel", 0), KS.queue_seq("tiny-rel", 0), KS.config(0), body)
        assert wait_terminal(r, [job_id], standing_worker) == {job_id: "succeeded"}
    assert standing_worker.proc is not None and standing_worker.proc.poll() is None


# --- HTTP ------------------------------------------------------------------------------------------------------

NUMBERS = [("max_tokens", 10**30), ("max_tokens", -1), ("max_tokens", 0), ("priority", -(10**20)),
           ("priority", 10**20), ("temperature", 1e308), ("temperature", -1e308), ("top_p", 0),
           ("seed", 10**30), ("seed", -1), ("n", 10**30), ("logprobs", 10**9), ("top_k", -(10**30)),
           ("min_tokens", -1), ("stop_token_ids", [-1]), ("prompt_token_ids", [10**30])]
# Accepted by the API, refused by the worker (the API has no range for them): a 400 once the job fails
# (OpenAI endpoints wait for it), a failed job otherwise; never a 5xx.
REFUSED_LATER = [("stop_token_ids", [10**30])]
LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000]
PATHS = ["/v1/jobs", "/v1/completions", "/v1/chat/completions", "/v1/jobs/batch"]


def _body(path: str, **fields: Any) -> dict[str, Any]:
    prompt: dict[str, Any]
    if path.endswith("chat/completions"):
        prompt = {"messages": [{"role": "user", "content": "Hi"}]}
    elif path.endswith("batch"):
        prompt = {"prompts": ["Hi"]}
    else:
        prompt = {"prompt": "Hi"}
    if "prompt_token_ids" in fields and path != "/v1/jobs":
        prompt, fields = {"prompt": fields["prompt_token_ids"]}, {}  # a token-id prompt, in OpenAI's form
        if path.endswith("batch"):
            prompt = {"prompts": [prompt["prompt"]]}
    return {**prompt, "max_tokens": 2, **fields}


def hostile_requests() -> list[tuple[str, str, dict[str, str], bytes]]:
    """(method, path, headers, body) of requests that must all be refused with a 4xx."""
    json_type = {"Content-Type": "application/json"}
    requests: list[tuple[str, str, dict[str, str], bytes]] = []
    for path in PATHS:
        requests += [
            ("POST", path, json_type, json.dumps(_body(path, prompt="x" * (2 * 1024 * 1024))).encode()),  # 2 MiB
            ("POST", path, json_type, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),  # nested
            ("POST", path, json_type, b'{"prompt": "\xff\xfe invalid utf-8", "max_tokens": 2}'),
            ("POST", path, json_type, b'{"prompt": "raw NUL \x00 inside", "max_tokens": 2}'),
            ("POST", path, json_type, json.dumps(_body(path, prompt="lone \ud800 surrogate")).encode()),
            ("POST", path, json_type, json.dumps(_body(path, stop=["\udfff"])).encode()),
            ("POST", path, json_type, b"\x00" * 64),
            ("POST", path, json_type, b""),
            ("POST", path, {"Content-Type": "text/plain"}, b"prompt=hi"),
            ("POST", path, json_type, json.dumps(_body(path, stop=["s"] * 10_000)).encode()),
        ]
        for field, value in NUMBERS:
            if not (field == "prompt_token_ids" and path.endswith("chat/completions")):
                requests.append(("POST", path, json_type, json.dumps(_body(path, **{field: value})).encode()))
        for literal in LITERALS:
            for field in ("temperature", "max_tokens", "top_p", "priority"):
                text = json.dumps(_body(path, **{field: "LITERAL"})).replace('"LITERAL"', literal)
                requests.append(("POST", path, json_type, text.encode()))
    return requests


async def test_hostile_http_requests_get_4xx_never_5xx(api_process: ApiProcess, standing_worker: WorkerProcess,
                                                       redis_url: str) -> None:
    outcomes: dict[int, int] = {}
    server_errors = []
    async with httpx.AsyncClient(base_url=api_process.base_url, timeout=60) as client:
        for method, path, headers, body in hostile_requests():
            response = await client.request(method, path, headers=headers, content=body)
            outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
            if response.status_code >= 500 or response.status_code < 400:
                server_errors.append((path, body[:120], response.status_code, response.text[:300]))
            else:
                assert response.json()["error"]["message"], response.text

        for path in PATHS:
            for field, value in REFUSED_LATER:
                response = await client.post(path, json=_body(path, **{field: value}))
                if response.status_code >= 500:
                    server_errors.append((path, field, response.status_code, response.text[:300]))

        # Headers and ids no client should send, on a job that exists.
        job_id = await submit(client, "A real job", max_tokens=2)
        await poll(client, job_id)
        for last_event_id in ["abc", "-1", str(10**30), "1" * 5000, "\u00e9"]:
            response = await client.get(f"/v1/jobs/{job_id}/events",
                                        headers={"Last-Event-ID": last_event_id.encode()})
            if response.status_code != 400:  # a clean 400 naming the header, never a 200 with an error in-band
                server_errors.append(("Last-Event-ID", last_event_id[:40], response.status_code, response.text[:300]))
            elif response.json()["error"]["param"] != "Last-Event-ID":
                server_errors.append(("Last-Event-ID", last_event_id[:40], "param", response.text[:300]))
        for path in [f"/v1/jobs/{job_id}/events?after={10**30}", f"/v1/jobs/{'x' * 5000}", "/v1/jobs/%00%ff",
                     "/v1/jobs/..%2f..%2fetc%2fpasswd", f"/v1/jobs/{job_id}/events?after=-1"]:
            response = await client.get(path)
            if response.status_code >= 500:
                server_errors.append((path[:60], b"", response.status_code, response.text[:300]))
        healthy = await client.get("/healthz")
    assert server_errors == [], "\n".join(map(repr, server_errors))
    assert outcomes.get(413, 0) >= len(PATHS) and outcomes.get(400, 0) > 100
    assert healthy.status_code == 200
    await asyncio.sleep(0)
