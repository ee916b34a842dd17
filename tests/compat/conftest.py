"""Client-compatibility fixtures: real services for the session (each model loads once): the API (uvicorn) and
the production worker over a real engine (SmolLM2, or a tiny random-weight model), both in process, so real
client libraries (openai, LangChain, LiteLLM) can talk to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.config import Settings
from shared.launcher.redis_server import RedisServer
from tests.in_process_api import serve_api
from tests.worker.scripted_engine import InProcessWorker
from worker.engine import Engine
from worker.main import engine_config


@dataclass
class Service:
    base_url: str  # the OpenAI base URL: http://host:port/v1
    model: str


def _serve(redis_server: RedisServer, model: str, name: str) -> Iterator[Service]:
    """The API and a worker serving ``model`` as ``name`` until the generator is closed (the session's end). The
    name is the compat suite's own: the worker must not claim the jobs other suites queue on this Redis."""
    if not redis_server.running:
        redis_server.start()
    settings = Settings(redis_url=redis_server.url, model=model, model_name=name, max_num_seqs=8, num_threads=2,
                        lease_ttl_s=30.0, heartbeat_interval_s=1.0)
    worker = InProcessWorker(redis_server.url, settings, worker_id=f"compat-{name}",
                             make_engine=lambda: Engine(engine_config(settings))).start()
    api = serve_api(settings, start_timeout_s=30)
    try:
        yield Service(base_url=f"{api.base_url}/v1", model=name)
    finally:
        api.stop()
        worker.stop()


@pytest.fixture(scope="session")
def compat_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The compat services' own redis-server: their APIs' background loops (lease reaper, deadline expirer, batch
    runner) act on every job of the Redis they use, so they must not share the other suites' session Redis."""
    server = RedisServer(tmp_path_factory.mktemp("compat-redis"), appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def service(compat_redis: RedisServer) -> Iterator[Service]:
    """SmolLM2: the real model, for outputs whose content matters."""
    yield from _serve(compat_redis, "smollm2", "compat-smollm2")


@pytest.fixture(scope="session")
def tiny_service(compat_redis: RedisServer, tiny_llama: Path) -> Iterator[Service]:
    """A tiny random-weight Llama (SmolLM2's tokenizer and chat template): fast, for the protocol's breadth; under
    a grammar even random weights write valid calls and schema-valid JSON."""
    yield from _serve(compat_redis, str(tiny_llama), "compat-tiny")
