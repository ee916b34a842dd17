"""guidellm (the vLLM project's benchmark tool) as a smoke benchmark: ``guidellm run`` in a subprocess against the
tiny-model service, on chat and text completions, a few streamed requests at concurrency 2; the test reads
guidellm's own JSON report. guidellm streams with ``stream_options: {include_usage, continuous_usage_stats}``,
``max_tokens``/``max_completion_tokens`` and ``ignore_eos`` (its synthetic prompts ask for an exact length), and
counts tokens with the tokenizer given here (the model's folder: nothing is fetched from the hub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.compat.conftest import Service

pytestmark = pytest.mark.slow

NUM_REQUESTS = 4
OUTPUT_TOKENS = 8
TIMEOUT_S = 120
ENDPOINTS = {"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-"}


@dataclass
class _Run:
    process: subprocess.Popen[str]
    report: Path


def _start_guidellm(service: Service, tokenizer: Path, endpoint: str, workdir: Path) -> _Run:
    report = workdir / "benchmarks.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": service.base_url.removesuffix("/v1"), "model": service.model,
                    "request_format": endpoint, "timeout": 60},
        "profile": {"kind": "concurrent", "streams": 2},
        "constraints": [{"kind": "max_requests", "count": NUM_REQUESTS}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 16, "output_tokens": OUTPUT_TOKENS}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}
    (workdir / "scenario.json").write_text(json.dumps(scenario))
    # One worker process (guidellm's default is one per stream): each process imports torch and transformers.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(workdir / "hf"),
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    process = subprocess.Popen([sys.executable, "-m", "guidellm", "run", "--scenario", str(workdir / "scenario.json"),
                                "--disable-console-interactive"], cwd=workdir, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return _Run(process, report)


def _finish(run: _Run) -> dict[str, Any]:
    try:
        output, _ = run.process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.process.kill()
        output, _ = run.process.communicate()
        pytest.fail(f"guidellm ran past {TIMEOUT_S} s: {output[-3000:]}")
    assert run.process.returncode == 0, output[-6000:]
    result: dict[str, Any] = json.loads(run.report.read_text())
    return result


@pytest.fixture(scope="module")
def reports(tiny_service: Service, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, dict[str, Any]]:
    """guidellm's report of each endpoint. Both runs go at once: most of a run is guidellm starting (its imports,
    its worker processes), so on a small machine the two overlap well."""
    runs = {endpoint: _start_guidellm(tiny_service, tiny_llama, endpoint, tmp_path_factory.mktemp("guidellm"))
            for endpoint in ENDPOINTS}
    return {endpoint: _finish(run) for endpoint, run in runs.items()}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_guidellm_benchmark_completes_every_request(reports: dict[str, dict[str, Any]], endpoint: str) -> None:
    [benchmark] = reports[endpoint]["benchmarks"]
    assert benchmark["config"]["strategy"]["streams"] == 2
    requests = benchmark["requests"]
    unfinished = [(r["info"]["status"], r["info"]["error"]) for r in requests["errored"] + requests["incomplete"]]
    assert benchmark["metrics"]["request_totals"] == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0,
                                                      "total": NUM_REQUESTS}, unfinished
    assert benchmark["scheduler_state"]["successful_requests"] == NUM_REQUESTS
    # What guidellm saw of each request, in one comparison so that a failure shows all of it.
    seen = [{"status": r["info"]["status"], "error": r["info"]["error"],
             "answered_by_the_service": r["response_id"].startswith(ENDPOINTS[endpoint]),
             "stream_options": json.loads(r["request_args"])["body"]["stream_options"],
             "has_prompt_tokens": r["prompt_tokens"] > 0, "output_tokens": r["output_tokens"],
             "has_output": bool(r["output"]), "has_ttft": (r["time_to_first_token_ms"] or 0) > 0}
            for r in requests["successful"]]
    expected = {"status": "completed", "error": None, "answered_by_the_service": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "has_prompt_tokens": True, "output_tokens": OUTPUT_TOKENS,  # ignore_eos: exactly as asked for
                "has_output": True, "has_ttft": True}
    assert seen == [expected] * NUM_REQUESTS
    assert benchmark["metrics"]["output_token_count"]["successful"]["total_sum"] == NUM_REQUESTS * OUTPUT_TOKENS
