"""What a newcomer meets first (issue 24): error messages that name the field and the fix, a running job that
shows its text so far when polled, and /docs that works without internet."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
from conftest import ApiServer, wait_until

from api.progress import fold_choices
from tests.worker.scripted_engine import InProcessWorker, expected_text


def _error(response: httpx.Response) -> dict[str, str | None]:
    assert response.status_code == 400, response.text
    error: dict[str, str | None] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_invalid_json_says_where_and_how_to_send_json(api: ApiServer) -> None:
    with api.client() as client:
        error = _error(client.post("/v1/jobs", content=b'{"prompt": "a", ', headers={"content-type":
                                                                                 "application/json"}))
    assert error["code"] == "invalid_json" and error["param"] is None
    assert error["message"] is not None
    assert error["message"].startswith("The request body is not valid JSON (")
    assert "at character 16" in error["message"] and "content-type: application/json" in error["message"]


def test_a_body_without_json_content_type_names_the_header(api: ApiServer) -> None:
    with api.client() as client:
        # What `curl -d '{...}'` without -H sends: application/x-www-form-urlencoded.
        form = _error(client.post("/v1/jobs", content=b'{"prompt": "a"}',
                                  headers={"content-type": "application/x-www-form-urlencoded"}))
        bare = _error(client.post("/v1/jobs", content=b'{"prompt": "a"}'))
        not_object = _error(client.post("/v1/jobs", json=[1, 2]))
        empty = _error(client.post("/v1/jobs", content=b"", headers={"content-type": "application/json"}))
    assert form["code"] == "invalid_content_type"
    assert "content-type 'application/x-www-form-urlencoded'" in str(form["message"])
    assert "-H 'content-type: application/json'" in str(form["message"])
    assert bare["code"] == "invalid_content_type" and "no content-type" in str(bare["message"])
    assert not_object["code"] == "invalid_json" and "must be a JSON object, got an array" in str(not_object["message"])
    assert empty["code"] == "missing_body" and str(empty["message"]).startswith("The request has no body; send a")


def test_missing_unknown_and_out_of_range_parameters_are_named(api: ApiServer) -> None:
    with api.client() as client:
        no_prompt = _error(client.post("/v1/jobs", json={"max_tokens": 4}))
        two_prompts = _error(client.post("/v1/jobs", json={"prompt": "a", "prompt_token_ids": [1]}))
        no_prompts = _error(client.post("/v1/jobs/batch", json={"max_tokens": 4}))
        typo = _error(client.post("/v1/jobs", json={"prompt": "a", "tempurature": 0.5}))
        negative = _error(client.post("/v1/jobs", json={"prompt": "a", "temperature": -1}))
    assert no_prompt == {"message": "Missing required parameter: 'prompt' (or 'messages' or 'prompt_token_ids').",
                         "type": "invalid_request_error", "param": "prompt", "code": "missing_required_parameter"}
    assert two_prompts["param"] == "prompt"
    assert two_prompts["message"] == "Give only one of 'prompt', 'messages' or 'prompt_token_ids', not 2."
    assert no_prompts["message"] == "Missing required parameter: 'prompts'." and no_prompts["param"] == "prompts"
    assert no_prompts["code"] == "missing_required_parameter"
    assert typo["message"] == "Unrecognized request argument supplied: 'tempurature'; remove it or check its spelling."
    assert typo["code"] == "unknown_parameter"
    assert negative["param"] == "temperature"
    assert re.fullmatch(r"Invalid value for 'temperature': .*0.* \(got -1\)\.", str(negative["message"]))


def test_a_running_job_polls_with_its_text_so_far_and_prompt_tokens(
        api: ApiServer, start_worker: Callable[..., InProcessWorker]) -> None:
    start_worker(token_delay_s=0.05)
    prompt = "hello quick brown fox"
    with api.client() as client:
        job_id = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 60, "n": 2}).json()["id"]
        seen: list[dict[str, object]] = []

        def polled_mid_run() -> bool:
            job = client.get(f"/v1/jobs/{job_id}").json()
            seen.append(job)
            return job["status"] == "running" and len(job["choices"][0]["token_ids"]) >= 3

        wait_until(polled_mid_run, what="a running job with three tokens")
        running = seen[-1]
        full = expected_text(prompt, 60)
        num_tokens = len(running["choices"][0]["token_ids"])  # type: ignore[index]
        assert running["text"] == expected_text(prompt, num_tokens)
        assert full.startswith(str(running["text"])) and running["text"] != full
        assert running["choices"][1]["text"].startswith(expected_text(prompt, 1, index=1))  # type: ignore[index]
        assert running["finish_reason"] is None
        assert running["usage"]["prompt_tokens"] == 4  # type: ignore[index]  # the word tokenizer: one per word
        assert running["usage"]["completion_tokens"] >= num_tokens  # type: ignore[index]
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", what="the end")
        assert client.get(f"/v1/jobs/{job_id}").json()["text"] == full
        queued_before = [job for job in seen if job["status"] == "queued"]
        assert all(job["text"] is None for job in queued_before)


def test_docs_are_served_without_a_cdn(api: ApiServer) -> None:
    with api.client() as client:
        page = client.get("/docs")
        assert page.status_code == 200
        assets = re.findall(r"""(?:src|href)=["']([^"']+\.(?:js|css))["']""", page.text)
        assert assets and all(asset.startswith("/") for asset in assets), assets
        for asset in assets:
            response = client.get(asset)
            assert response.status_code == 200 and len(response.content) > 10_000, asset
        assert "cdn" not in page.text.lower()
        assert client.get("/redoc").status_code == 200


def test_the_text_so_far_starts_over_at_a_restart_event() -> None:
    log = [{"seq": 1, "type": "token", "index": 0, "text": "dead ", "token_ids": [7]},
           {"seq": 2, "type": "restart", "attempt": 2},
           {"seq": 3, "type": "token", "index": 1, "text": "b", "token_ids": [5]},
           {"seq": 4, "type": "token", "index": 0, "text": "a", "token_ids": [3, 4]},
           {"seq": 5, "type": "token", "index": 0, "text": "c", "token_ids": [6]}]
    choices = fold_choices(log, num_choices=2)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in choices] == [(0, "ac", [3, 4, 6], None),
                                                                                 (1, "b", [5], None)]
