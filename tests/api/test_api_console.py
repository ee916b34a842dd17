"""The console's API: ``GET /v1/jobs`` (the caller's recent jobs), ``GET /v1/fleet`` (queues, workers, history),
both tenant-isolated, and the static console at ``/ui`` (served from the package, with a strict CSP)."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import redis

from shared import keys
from tests.api.conftest import ApiServer, wait_until
from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

KEY_A, KEY_B = "key-a", "key-b"


def submit(client: httpx.Client, prompt: str, **fields: object) -> str:
    r = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 4, **fields})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def wait_done(client: httpx.Client, job_id: str) -> dict[str, object]:
    seen: list[dict[str, object]] = []

    def done() -> bool:
        seen[:] = [client.get(f"/v1/jobs/{job_id}").json()]
        return seen[0]["status"] in ("succeeded", "failed", "cancelled")

    wait_until(done, what=f"job {job_id} to finish")
    return seen[0]


def test_job_list_shows_only_the_callers_jobs_newest_first(start_api: Callable[..., ApiServer],
                                                         worker: InProcessWorker) -> None:
    api = start_api(api_keys=[KEY_A, KEY_B])
    with api.client(KEY_A) as a, api.client(KEY_B) as b:
        a_ids = [submit(a, "hello world", priority=p) for p in (0, 3)]
        b_id = submit(b, "the quick fox")
        for job_id in a_ids:
            wait_done(a, job_id)
        listed = a.get("/v1/jobs").json()["data"]
        assert [j["id"] for j in listed] == a_ids[::-1]
        newest = listed[0]
        assert newest["status"] == "succeeded" and newest["priority"] == 3 and newest["model"] == MODEL
        assert newest["preview"] == expected_text("hello world", 4)
        assert newest["finish_reason"] == "length" and newest["usage"]["completion_tokens"] == 4
        assert newest["created_at"] <= newest["started_at"] <= newest["first_token_at"] <= newest["finished_at"]
        assert [j["id"] for j in b.get("/v1/jobs").json()["data"]] == [b_id]
        assert [j["id"] for j in a.get("/v1/jobs", params={"limit": 1}).json()["data"]] == a_ids[-1:]
        assert a.get("/v1/jobs", params={"limit": 0}).status_code == 400
        assert a.get("/v1/jobs", params={"limit": 101}).status_code == 400
    with api.client() as anonymous:
        assert anonymous.get("/v1/jobs").status_code == 401


def test_job_list_skips_expired_jobs(api: ApiServer, worker: InProcessWorker) -> None:
    with api.client() as client:
        kept, expired = submit(client, "hello"), submit(client, "world")
        wait_done(client, kept)
        wait_done(client, expired)
        with redis.Redis.from_url(api.settings.redis_url or "") as r:
            r.delete(KS.job(expired))
            assert r.ttl(KS.owner_jobs(None, 0)) > 0  # the index itself expires with the results
        assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == [kept]


def test_fleet_shows_queues_workers_and_only_the_callers_running_jobs(
        start_api: Callable[..., ApiServer], start_worker: Callable[..., InProcessWorker]) -> None:
    api = start_api(api_keys=[KEY_A, KEY_B])
    worker = start_worker(token_delay_s=0.05)
    with api.client(KEY_A) as a, api.client(KEY_B) as b:
        mine = submit(a, "hello world", max_tokens=200)
        theirs = submit(b, "the quick fox", max_tokens=200)
        queued = submit(a, "brown fox", priority=-5)  # max_num_seqs is 8: it runs too; the depth is checked below

        def both_running() -> bool:
            view = a.get("/v1/fleet").json()
            return sum(len(w["your_job_ids"]) + w["num_other_jobs"] for w in view["workers"]) >= 2

        wait_until(both_running, what="both long jobs running")
        view = a.get("/v1/fleet").json()
        (shown,) = view["workers"]
        assert shown["id"] == worker.worker_id and shown["model"] == MODEL
        assert mine in shown["your_job_ids"] and theirs not in shown["your_job_ids"]
        assert shown["num_other_jobs"] == 1
        assert 0 <= shown["kv_cache_usage"] <= 1
        (queue,) = [q for q in view["queues"] if q["model"] == MODEL]
        assert queue["num_live_workers"] == 1 and queue["num_queued"] == sum(queue["depth_by_priority"].values())
        theirs_view = b.get("/v1/fleet").json()["workers"][0]
        assert theirs_view["your_job_ids"] == [theirs]

        def throughput_charted() -> bool:
            history = a.get("/v1/fleet").json()["history"]
            return any(p["tokens_per_s"] > 0 and p["num_running"] >= 1 for p in history)

        wait_until(throughput_charted, what="a history point with throughput")
        a.delete(f"/v1/jobs/{mine}")
        b.delete(f"/v1/jobs/{theirs}")
        wait_done(a, queued)

        def latency_charted() -> bool:
            history = a.get("/v1/fleet").json()["history"]
            return any(p["mean_e2e_s"] and p["mean_ttft_s"] and p["jobs_per_s"] > 0 for p in history)

        wait_until(latency_charted, what="a history point with latency")
        assert a.get("/v1/fleet").json()["workers"][0]["tokens_per_s"] >= 0


def test_console_is_served_with_its_files_and_a_strict_csp(api: ApiServer) -> None:
    with api.client(follow_redirects=False) as client:
        assert client.get("/ui").status_code in (307, 308)
        assert client.get("/ui").headers["location"] == "/ui/"
        page = client.get("/ui/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "unsafe-inline" not in csp and "script-src 'self'" in csp
        assets = re.findall(r'(?:src|href)="([^"#:]+)"', page.text)
        scripts = ["app.js"]
        seen: set[str] = set()
        while scripts:  # every module the page imports, followed through the import graph
            name = scripts.pop()
            seen.add(name)
            r = client.get(f"/ui/{name}")
            assert r.status_code == 200 and "javascript" in r.headers["content-type"], name
            assert "http://" not in r.text and "https://" not in r.text, f"{name} reaches outside the server"
            scripts += [m for m in re.findall(r'from "\./([\w-]+\.js)"', r.text) if m not in seen]
        assert {"api.js", "playground.js", "jobs.js", "batches.js", "fleet.js", "chart.js", "dom.js"} <= seen
        for asset in assets:
            assert client.get(f"/ui/{asset}").status_code == 200, asset
        assert client.get("/ui/nope.js").status_code == 404


def test_fleet_needs_a_valid_key(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(api_keys=[KEY_A])
    with api.client() as anonymous, api.client("wrong") as wrong, api.client(KEY_A) as a:
        assert anonymous.get("/v1/fleet").status_code == 401
        assert wrong.get("/v1/fleet").status_code == 401
        view = a.get("/v1/fleet").json()
        assert view["workers"] == [] and view["num_dead_letters"] == 0
        assert [q["model"] for q in view["queues"]] == [MODEL]
