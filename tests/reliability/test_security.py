"""Security properties of a deployed stack (docs/security.md): a password-protected Redis end to end, TLS to
Redis (rediss:// with a CA), no prompt or output text, API key or Redis password in the logs, no API key in
Redis, and unguessable job ids."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from shared import keys
from shared.config import Settings
from shared.launcher.redis_server import RedisServer, find_redis_server, free_port
from shared.queue import JobQueue
from tests.queue.queue_helpers import make_job, queue_depth
from tests.reliability.stack import MODEL, ApiProcess, follow, poll, submit
from tests.worker.worker_process import WorkerProcess

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow

PASSWORD = "pw-" + secrets.token_hex(12)
API_KEYS = ("key-alice-" + secrets.token_hex(8), "key-bob-" + secrets.token_hex(8))


@dataclass
class SecuredStack:
    redis: RedisServer
    api: ApiProcess
    worker: WorkerProcess


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[SecuredStack]:
    """Redis with a password (the URL carries it), an API with keys and a worker: the production shape."""
    server = RedisServer(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD).start()
    logs = tmp_path_factory.mktemp("secured-logs")
    api = ApiProcess(server.url, logs, api_keys=",".join(API_KEYS))
    worker = WorkerProcess(server.url, tiny_llama, logs, "secured-w1", name=MODEL)
    try:
        api.start()
        worker.start()
        yield SecuredStack(server, api, worker)
    finally:
        worker.stop()
        api.stop()
        server.stop()


def test_redis_password_is_required_and_works_end_to_end(secured: SecuredStack) -> None:
    anonymous = f"redis://127.0.0.1:{secured.redis.port}/0"
    with redis.Redis.from_url(anonymous) as r, pytest.raises(redis.AuthenticationError):
        r.get("x")
    with redis.Redis.from_url(anonymous.replace("//", "//:wrong-password@")) as r, \
            pytest.raises(redis.AuthenticationError):
        r.get("x")
    with httpx.Client(base_url=secured.api.base_url, headers={"Authorization": f"Bearer {API_KEYS[0]}"},
                      timeout=30) as client:
        job_id = client.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 4}).json()["id"]
        deadline = time.monotonic() + 60
        while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, secured.worker.log_tail()
            time.sleep(0.05)
    assert job["status"] == "succeeded" and job["worker_id"] == "secured-w1"


async def test_no_prompt_output_key_or_password_in_logs_and_no_api_key_in_redis(secured: SecuredStack) -> None:
    marker = "zebra-" + secrets.token_hex(8)  # appears nowhere unless a prompt is written out
    headers = {"Authorization": f"Bearer {API_KEYS[1]}"}
    async with httpx.AsyncClient(base_url=secured.api.base_url, headers=headers, timeout=60) as client:
        job_id = await submit(client, f"{marker} tell me a story", max_tokens=24, ignore_eos=True, stop=[marker])
        streamed = await follow(client, job_id)
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": marker}, {"role": "user", "content": f"{marker}?"}],
            "max_tokens": 24})
        assert chat.status_code == 200, chat.text
        too_long = await client.post("/v1/jobs", json={"prompt": f"{marker} " * 2000, "max_tokens": 4})
        assert too_long.status_code == 400 and marker not in too_long.text
        bad = await client.post("/v1/jobs", json={"prompt": marker, "temperature": -1})
        assert bad.status_code == 400
    # A malformed job pushed into Redis by another backend: the worker's "invalid job" warning must not quote it.
    with redis.Redis.from_url(secured.redis.url) as r:
        raw_id = "raw-" + secrets.token_hex(8)
        r.hset(KS.job(raw_id), mapping={"id": raw_id, "model": "tiny-rel", "status": "queued", "score": 0,
                                          "submission": json.dumps({"id": raw_id, "model": "tiny-rel", "prompt": marker,
                                                                    "messages": [{"role": "user",
                                                                                  "content": marker}]})})
        r.zadd(KS.queue("tiny-rel", 0), {raw_id: 0})
        deadline = time.monotonic() + 30
        while r.hget(KS.job(raw_id), "status") != b"failed":
            assert time.monotonic() < deadline, secured.worker.log_tail()
            time.sleep(0.05)
        stored = _all_values(r)

    outputs = [streamed.final["text"], chat.json()["choices"][0]["message"]["content"]]
    assert all(len(text) > 20 for text in outputs)
    logs = {"api": secured.api.log_text(), "worker": secured.worker.log_path.read_text(errors="replace")}
    assert f"job {job_id}" in logs["worker"], "the worker's log should mention the job by id"
    for name, text in logs.items():
        for secret in (marker, *outputs, *API_KEYS, PASSWORD):
            assert secret not in text, f"{name} log holds {secret[:30]!r}"
    # Jobs record a hash of the API key that made them, never the key itself.
    assert marker.encode() in stored  # the prompts are there (Redis is trusted, docs/security.md) ...
    for key in API_KEYS:
        assert key.encode() not in stored  # ... the API keys are not


def _all_values(r: redis.Redis) -> bytes:
    """Every key name and value in Redis, concatenated (hashes, strings, sets, sorted sets, streams)."""
    parts: list[bytes] = []
    for key in r.scan_iter(count=1000):
        parts.append(key)
        kind = r.type(key)
        if kind == b"hash":
            parts += [b for pair in r.hgetall(key).items() for b in pair]
        elif kind == b"string":
            parts.append(r.get(key) or b"")
        elif kind == b"set":
            parts += list(r.smembers(key))
        elif kind == b"zset":
            parts += r.zrange(key, 0, -1)
        elif kind == b"stream":
            parts += [b for _, fields in r.xrange(key) for pair in fields.items() for b in pair]
    return b"\n".join(parts)


def test_job_ids_from_the_api_are_unguessable(api_process: ApiProcess, redis_url: str) -> None:
    """32 hex characters of 128 random bits: every position varies (uuid4 fixes 6 bits: the version nibble,
    position 12, and two variant bits at position 16)."""
    with httpx.Client(base_url=api_process.base_url, timeout=30) as client:
        response = client.post("/v1/jobs/batch", json={"prompts": ["x"] * 256, "max_tokens": 1})
        assert response.status_code == 202, response.text
        ids = [job["id"] for job in response.json()["data"]]
    assert len(set(ids)) == 256
    assert all(len(job_id) == 32 and set(job_id) <= set("0123456789abcdef") for job_id in ids)
    distinct = [len({job_id[i] for job_id in ids}) for i in range(32)]
    assert min(distinct) >= 8, distinct  # 256 draws of 16 values: a random position shows almost all 16


# --- TLS -------------------------------------------------------------------------------------------------------


def _openssl(tmp: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)


def _make_certificates(tmp: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    _openssl(tmp, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=tokenspool test CA")
    _openssl(tmp, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1")
    (tmp / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(tmp, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server that only speaks TLS (``--port 0``), with a password; yields its ``rediss://`` URL."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    tmp = tmp_path_factory.mktemp("redis-tls")
    _make_certificates(tmp)
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", "server.crt", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt",
         "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
         "--dir", str(tmp), "--logfile", "redis.log"], cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={tmp / 'ca.crt'}"
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                output = (proc.stdout.read() if proc.stdout else b"").decode(errors="replace")
                log = (tmp / "redis.log").read_text(errors="replace") if (tmp / "redis.log").exists() else ""
                if "tls" in (output + log).lower():
                    pytest.skip(f"this redis-server was built without TLS support: {(output + log)[-300:]}")
                raise RuntimeError(f"TLS redis-server exited: {output}{log}")
            try:
                with redis.Redis.from_url(url) as r:
                    r.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "TLS redis-server did not answer"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


async def test_rediss_url_with_a_ca_works_for_the_queue_the_api_and_a_worker(
        tls_redis: str, tmp_path: Path, tiny_llama: Path) -> None:
    # The plain protocol is refused: the TLS port speaks nothing else, and an untrusted server is rejected.
    plain = tls_redis.replace("rediss://", "redis://").split("?")[0]
    with redis.Redis.from_url(plain, socket_timeout=2) as r, pytest.raises(redis.ConnectionError):
        r.ping()
    with redis.Redis.from_url(tls_redis.split("?")[0] + "?ssl_cert_reqs=required", socket_timeout=5) as r, \
            pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        r.ping()

    client = AsyncRedis.from_url(tls_redis)
    try:
        queue = JobQueue(client, Settings(redis_url=tls_redis), poll_interval_s=0.2)
        job = make_job(model="tiny-rel")
        record, created = await queue.submit(job)
        assert created and (await queue.get(job.id)) == record
        assert await queue_depth(queue, "tiny-rel") == 1
    finally:
        await client.aclose()

    # The worker and the API take the same URL from their settings.
    api = ApiProcess(tls_redis, tmp_path)
    worker = WorkerProcess(tls_redis, tiny_llama, tmp_path, "tls-w1", name=MODEL)
    try:
        api.start()
        worker.start()
        async with httpx.AsyncClient(base_url=api.base_url, timeout=60) as http:
            job_id = await submit(http, "Over TLS", max_tokens=4)
            final, _ = await poll(http, job_id, timeout_s=60)
            earlier, _ = await poll(http, job.id, timeout_s=60)
    finally:
        worker.stop()
        api.stop()
    assert final["status"] == "succeeded" and final["worker_id"] == "tls-w1"
    assert earlier["status"] == "succeeded"
