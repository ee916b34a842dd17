"""The console in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by
selenium) against a real stack: ``tokenspool api`` (with an API key) and a worker serving SmolLM2 on CPU.

Submit in the playground and watch tokens arrive, cancel, find both jobs in the list, follow a running job on its
page across an API restart (the page resumes with Last-Event-ID: no token lost or doubled), and see the worker on
the fleet page; on the batches page, watch a batch complete, cancel a running one from its row and download their
output and error files. With ``TOKENSPOOL_SCREENSHOTS=<dir>`` each page is saved there as PNG (docs/screenshots/ in
the README is made so: ``TOKENSPOOL_SCREENSHOTS=docs/screenshots make test PYTEST_ARGS=tests/console``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared.launcher.redis_server import RedisServer
from tests.conftest import smollm2_folder
from tests.reliability.stack import ApiProcess
from tests.worker.worker_process import WorkerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "console-test-key"
MODEL = "smollm2"
WORKER_ID = "console-worker"
TIMEOUT_S = 60.0


def find_browser() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("the console's browser tests need chromium and chromedriver: as root, `make setup` installs "
                    "them (apt-get install chromium chromium-driver)")
    return chromium, driver


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    """An API process requiring ``API_KEY`` and one SmolLM2 worker, on a flushed Redis."""
    find_browser()
    if not redis_server.running:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushall()
    logs = tmp_path_factory.mktemp("console-logs")
    # Leases long enough that a worker starved of CPU on a busy machine still counts as live (the test helpers'
    # 2 s lease is for fault tests); heartbeats often enough that the charts move within the test.
    leases = {"lease_ttl_s": 15, "heartbeat_interval_s": 0.5}
    # Batches advance every 0.2 s (1 s by default), so the batches page's progress moves within the test.
    api = ApiProcess(redis_server.url, logs, model=MODEL, api_keys=API_KEY, batch_poll_s=0.2, **leases)
    worker = WorkerProcess(redis_server.url, smollm2_folder(), logs, WORKER_ID, name=MODEL, max_num_seqs=4,
                           **leases)
    try:
        api.start()
        worker.start(timeout_s=180)
        yield api
    finally:
        worker.stop()
        api.stop()


@pytest.fixture(scope="module")
def browser(stack: ApiProcess) -> Iterator[Any]:
    from selenium import webdriver

    chromium, driver_path = find_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,960", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.get(f"{stack.base_url}/ui")
        driver.find_element("id", "api-key").send_keys(API_KEY)
        driver.find_element("css selector", "#key-form button").click()
        yield driver
    finally:
        driver.quit()


def api_client(stack: ApiProcess) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)


def wait_for(browser: Any, condition: Callable[[], Any], what: str, timeout_s: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            errors = browser.execute_script(
                "return [...document.querySelectorAll('.error')].map((e) => e.textContent).filter(Boolean)")
            raise AssertionError(f"timed out waiting for {what}; page errors: {errors}")
        time.sleep(0.05)


# Read in the page with one script each: the pages re-render nodes as events arrive, so a node found by one
# WebDriver call may be gone (stale) by the next.
def text_of(browser: Any, element_id: str) -> str:
    """The element's exact text (textContent: untrimmed, unlike selenium's ``.text``)."""
    return str(browser.execute_script("return document.getElementById(arguments[0]).textContent", element_id))


def status_of(browser: Any, element_id: str) -> str:
    return str(browser.execute_script(
        "const b = document.querySelector('#' + arguments[0] + ' .badge'); return b ? b.dataset.status : ''",
        element_id))


def count_of(browser: Any, selector: str) -> int:
    return int(browser.execute_script("return document.querySelectorAll(arguments[0]).length", selector))


def screenshot(browser: Any, name: str) -> None:
    folder = os.environ.get("TOKENSPOOL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(folder) / f"{name}.png"))


def fill(browser: Any, element_id: str, value: str) -> None:
    field = browser.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def send_prompt(browser: Any, prompt: str, max_tokens: int, mode: str) -> None:
    from selenium.webdriver.support.select import Select

    wait_for(browser, lambda: browser.find_elements("css selector", f"#pg-model option[value='{MODEL}']"),
             "the model list")
    Select(browser.find_element("id", "pg-mode")).select_by_value(mode)
    fill(browser, "pg-max_tokens", str(max_tokens))
    fill(browser, "pg-temperature", "0")
    fill(browser, "pg-prompt", prompt)
    browser.find_element("id", "pg-send").click()


def job_record(stack: ApiProcess, job_id: str) -> dict[str, Any]:
    with api_client(stack) as client:
        record: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
    return record


def test_playground_streams_a_completion_then_cancels_a_long_one(browser: Any, stack: ApiProcess) -> None:
    browser.get(f"{stack.base_url}/ui/#/playground")
    # The key lives in this tab's sessionStorage only: no localStorage, no cookie.
    assert browser.execute_script("return [localStorage.length, document.cookie, "
                                  "sessionStorage.getItem('tokenspool.apiKey')]") == [0, "", API_KEY]
    send_prompt(browser, "The capital of France is", 12, "completion")
    # Tokens show while the job still runs: a partial text, never the whole answer at once.
    wait_for(browser, lambda: text_of(browser, "pg-output") and status_of(browser, "pg-status") == "running",
             "the first tokens while running")
    wait_for(browser, lambda: status_of(browser, "pg-status") == "succeeded", "the job to succeed")
    job_id = text_of(browser, "pg-job-link")
    record = job_record(stack, job_id)
    assert text_of(browser, "pg-output") == record["text"]
    assert text_of(browser, "pg-tokens") == "12" == str(record["usage"]["completion_tokens"])
    assert text_of(browser, "pg-finish") == "length"
    assert float(text_of(browser, "pg-tps")) > 0
    assert text_of(browser, "pg-ttft").endswith(("ms", " s"))
    screenshot(browser, "playground")

    send_prompt(browser, "Write a long story about a lighthouse keeper.", 400, "chat")
    wait_for(browser, lambda: int(text_of(browser, "pg-tokens")) >= 3, "a few tokens of the long job")
    browser.find_element("id", "pg-cancel").click()
    wait_for(browser, lambda: status_of(browser, "pg-status") == "cancelled", "the job to be cancelled")
    record = job_record(stack, text_of(browser, "pg-job-link"))
    assert record["status"] == "cancelled" and record["usage"]["completion_tokens"] < 400
    assert text_of(browser, "pg-output") == record["text"]


def test_job_list_shows_the_callers_jobs(browser: Any, stack: ApiProcess) -> None:
    browser.get(f"{stack.base_url}/ui/#/jobs")
    wait_for(browser, lambda: count_of(browser, "#jobs-body tr[data-job-id]") >= 2, "two jobs in the list")
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#jobs-body tr[data-job-id]')].map((tr) => ({id: tr.dataset.jobId, "
        "status: tr.querySelector('.badge').dataset.status, cells: [...tr.cells].map((td) => td.textContent)}))")
    with api_client(stack) as client:
        expected = client.get("/v1/jobs").json()["data"]
    assert [r["id"] for r in rows] == [j["id"] for j in expected]
    assert [r["status"] for r in rows] == ["cancelled", "succeeded"]
    cells = rows[1]["cells"]
    assert cells[2] == MODEL and cells[4] == "0" and cells[8] == "length"
    assert cells[7].endswith("/ 12")
    screenshot(browser, "jobs")


def test_job_page_follows_a_running_job_across_an_api_restart(browser: Any, stack: ApiProcess) -> None:
    with api_client(stack) as client:
        # Long enough (no EOS) to still be running when the page cancels it, after a restart on a loaded machine:
        # at 200 tokens it could finish first (then "completed", never "cancelled").
        job_id = client.post("/v1/jobs", json={"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                                               "temperature": 0}).json()["id"]
    browser.get(f"{stack.base_url}/ui/#/jobs/{job_id}")
    wait_for(browser, lambda: count_of(browser, "#job-events tr") >= 4, "live events")
    assert status_of(browser, "job-live") == "live"
    stack.kill()  # the page's stream breaks mid-job; the job keeps running on the worker
    stack.start()
    wait_for(browser, lambda: "reconnected" in text_of(browser, "job-live"), "the page to reconnect")
    count = count_of(browser, "#job-events tr")
    wait_for(browser, lambda: count_of(browser, "#job-events tr") > count + 2,
             "events after the reconnect")
    screenshot(browser, "job")
    browser.find_element("id", "job-cancel").click()
    wait_for(browser, lambda: status_of(browser, "job-record") == "cancelled", "the job to be cancelled")
    record = job_record(stack, job_id)
    seqs = [int(x) for x in browser.execute_script(
        "return [...document.querySelectorAll('#job-events tr td:first-child')].map((td) => td.textContent)")]
    assert seqs == list(range(1, len(seqs) + 1)), "an event was lost or repeated across the reconnect"
    assert text_of(browser, "job-text") == record["text"]


def test_fleet_page_shows_the_worker_its_jobs_and_charts(browser: Any, stack: ApiProcess) -> None:
    with api_client(stack) as client:
        job_id = client.post("/v1/jobs", json={"prompt": "The history of the lighthouse", "max_tokens": 64,
                                               "temperature": 0}).json()["id"]
        browser.get(f"{stack.base_url}/ui/#/fleet")
        wait_for(browser, lambda: count_of(browser, f"tr[data-worker-id='{WORKER_ID}'] a[href='#/jobs/{job_id}']"),
                 "the running job on the worker's row")
        cells = browser.execute_script(
            "return [...document.querySelector(`tr[data-worker-id='${arguments[0]}']`).cells]"
            ".map((td) => td.textContent)", WORKER_ID)
        assert cells[1] == MODEL and cells[2].endswith("/ 4") and cells[6].startswith(job_id[:8])
        queue = browser.execute_script("return [...document.querySelector(`tr[data-model='${arguments[0]}']`).cells]"
                                       ".map((td) => td.textContent)", MODEL)
        assert queue[3] == "1"  # live workers
        wait_for(browser, lambda: any(p["tokens_per_s"] > 0 for p in client.get("/v1/fleet").json()["history"]),
                 "throughput in the fleet history")
        for chart in ("chart-throughput", "chart-load", "chart-latency"):
            assert browser.find_element("id", chart).size["height"] > 100
        time.sleep(2.5)  # one more refresh, so the charts have drawn the throughput
        screenshot(browser, "fleet")
        client.delete(f"/v1/jobs/{job_id}")


# --- batches ---------------------------------------------------------------------------------------------------


def create_batch(stack: ApiProcess, max_tokens: list[int]) -> str:
    """A ``/v1/completions`` batch of one line per ``max_tokens``, uploaded and started through the real API."""
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"Fact number {i} about lighthouses:", "max_tokens": n,
                       "temperature": 0, "ignore_eos": True}}
             for i, n in enumerate(max_tokens)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with api_client(stack) as client:
        upload = client.post("/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"})
        upload.raise_for_status()
        batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                                 "completion_window": "24h"})
        batch.raise_for_status()
    assert batch.json()["status"] == "in_progress", batch.json()
    return str(batch.json()["id"])


def batch_row(browser: Any, batch_id: str) -> dict[str, Any] | None:
    """The batch's row as shown: status, progress (done / max), counts and the buttons it offers."""
    row: dict[str, Any] | None = browser.execute_script("""
        const tr = document.querySelector(`#batches-body tr[data-batch-id='${arguments[0]}']`);
        if (!tr) return null;
        const bar = tr.querySelector('progress');
        const count = (name) => tr.querySelector(`[data-count='${name}']`).textContent;
        return {status: tr.querySelector('.badge').dataset.status, done: bar.value, max: bar.max,
                counts: [count('completed'), count('failed'), count('total')],
                files: [...tr.querySelectorAll('button[data-file]')].map((b) => b.dataset.file),
                can_cancel: !!tr.querySelector('button.batch-cancel')};
        """, batch_id)
    return row


def click(browser: Any, selector: str) -> None:
    """Click the element, finding it again when a refresh replaced it between the find and the click."""
    from selenium.common.exceptions import StaleElementReferenceException

    def try_click() -> bool:
        try:
            browser.find_element("css selector", selector).click()
            return True
        except StaleElementReferenceException:
            return False

    wait_for(browser, try_click, f"a click on {selector}", timeout_s=5)


def download(browser: Any, folder: Path, batch_id: str, kind: str) -> bytes:
    """Click the row's file button and return the file the browser saved."""
    click(browser, f"#batches-body tr[data-batch-id='{batch_id}'] button[data-file='{kind}']")
    saved = folder / f"{batch_id}_{kind}.jsonl"
    wait_for(browser, saved.exists, f"the {kind} file of {batch_id} to be saved")
    return saved.read_bytes()


def file_content(stack: ApiProcess, file_id: str) -> bytes:
    with api_client(stack) as client:
        response = client.get(f"/v1/files/{file_id}/content")
        response.raise_for_status()
        return response.content


def test_batches_page_shows_progress_cancels_and_downloads(browser: Any, stack: ApiProcess, tmp_path: Path) -> None:
    # The downloads land in tmp_path: a blob saved by <a download>, as a user's browser saves it.
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    done_id = create_batch(stack, [4, 4, 4])
    browser.get(f"{stack.base_url}/ui/#/batches")
    wait_for(browser, lambda: batch_row(browser, done_id), "the batch's row")
    wait_for(browser, lambda: (batch_row(browser, done_id) or {}).get("status") == "completed", "the batch to complete")
    row = batch_row(browser, done_id)
    assert row == {"status": "completed", "done": 3, "max": 3, "counts": ["3", "0", "3"], "files": ["output"],
                   "can_cancel": False}
    with api_client(stack) as client:
        batch = client.get(f"/v1/batches/{done_id}").json()
    assert download(browser, tmp_path, done_id, "output") == file_content(stack, batch["output_file_id"])

    # A batch whose first line is short and the others long: cancelled from its row while they run.
    cancel_id = create_batch(stack, [2, 300, 300])
    wait_for(browser, lambda: (batch_row(browser, cancel_id) or {}).get("done") == 1, "the short line to finish")
    row = batch_row(browser, cancel_id)
    assert row is not None and row["status"] == "in_progress" and row["can_cancel"] and row["max"] == 3
    screenshot(browser, "batches")
    click(browser, f"#batches-body tr[data-batch-id='{cancel_id}'] button.batch-cancel")
    wait_for(browser, lambda: (batch_row(browser, cancel_id) or {}).get("status") == "cancelled",
             "the batch to be cancelled")
    row = batch_row(browser, cancel_id)
    assert row == {"status": "cancelled", "done": 3, "max": 3, "counts": ["1", "2", "3"],
                   "files": ["output", "errors"], "can_cancel": False}
    with api_client(stack) as client:
        batch = client.get(f"/v1/batches/{cancel_id}").json()
    assert batch["status"] == "cancelled" and batch["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = download(browser, tmp_path, cancel_id, "errors")
    assert errors == file_content(stack, batch["error_file_id"])
    assert [json.loads(line)["custom_id"] for line in errors.splitlines()] == ["line-1", "line-2"]
