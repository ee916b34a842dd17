"""Beam search through the API, end to end: the production worker over a real engine (a tiny random model) returns
transformers' beams and scores as a job's choices (jobs API: ``beam_width``) and as OpenAI choices, best first
(vLLM's ``use_beam_search`` with ``n`` as the width); streaming and the combinations beam search cannot honour are
400s naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import ApiServer, wait_until
from transformers import AutoModelForCausalLM

from tests.engine.helpers import Case, pad_id, reference_beams
from tests.worker.scripted_engine import MODEL, InProcessWorker
from worker.engine import Engine, EngineConfig

PROMPT = [101, 2045, 977, 31, 4410, 8, 600, 12000]
CASE = Case(PROMPT, width=4, max_tokens=6, length_penalty=0.5, early_stopping=True, eos=None)
BEAM_FIELDS = {"max_tokens": 6, "length_penalty": 0.5, "early_stopping": True, "ignore_eos": True}


@pytest.fixture()
def real_worker(start_worker: Callable[..., InProcessWorker], tiny_llama: Path) -> InProcessWorker:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=8,
                          num_threads=1)
    return start_worker(make_engine=lambda: Engine(config))


def _finished_job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = {}

    def done() -> bool:
        job.update(client.get(f"/v1/jobs/{job_id}").json())
        return job["status"] in ("succeeded", "failed", "cancelled")

    wait_until(done, timeout_s=60, what="job end")
    assert job["status"] == "succeeded", job
    return job


def test_jobs_and_openai_return_transformers_beams_best_first(api: ApiServer, real_worker: InProcessWorker,
                                                              tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = reference_beams(model, CASE)
    with api.client() as client:
        created = client.post("/v1/jobs", json={"model": MODEL, "prompt_token_ids": PROMPT, "beam_width": 4, "n": 4,
                                                **BEAM_FIELDS})
        assert created.status_code == 202, created.text
        job = _finished_job(client, created.json()["id"])
        for choice, (ref_tokens, ref_score) in zip(job["choices"], expected, strict=True):
            tokens = choice["token_ids"]
            assert ref_tokens[:len(tokens)] == tokens and set(ref_tokens[len(tokens):]) <= {pad_id(CASE)}
            assert choice["beam_score"] == pytest.approx(ref_score, abs=1e-4)
        # n below the width: the best n of the same search.
        best = _finished_job(client, client.post("/v1/jobs", json={
            "model": MODEL, "prompt_token_ids": PROMPT, "beam_width": 4, "n": 2, **BEAM_FIELDS}).json()["id"])
        assert [c["token_ids"] for c in best["choices"]] == [c["token_ids"] for c in job["choices"][:2]]

        completion = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "use_beam_search": True,
                                                           "n": 4, **BEAM_FIELDS})
        assert completion.status_code == 200, completion.text
        choices = completion.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert [c["text"] for c in choices] == [c["text"] for c in job["choices"]]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "top_p": 0.9}, "top_p"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"use_beam_search": True, "n": 1}, "n"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty"),
    ("/v1/jobs", {"beam_width": 2, "n": 3}, "n"),
    ("/v1/jobs", {"beam_width": 2, "stop": ["."]}, "stop"),
    ("/v1/jobs", {"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ("/v1/jobs", {"beam_width": 65}, "beam_width"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_the_field(api: ApiServer, path: str, body: dict[str, Any],
                                                                   param: str) -> None:
    response = httpx.post(f"{api.base_url}{path}", json={"model": MODEL, "prompt": "hello world", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert param in response.json()["error"]["message"]


def test_beam_search_is_refused_where_workers_speculate(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(speculative="ngram")
    response = httpx.post(f"{api.base_url}/v1/jobs", json={"model": MODEL, "prompt": "hello", "beam_width": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "beam_width"
    response = httpx.post(f"{api.base_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
