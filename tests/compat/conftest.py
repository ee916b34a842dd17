"""Client-compatibility fixtures: one real service for the module, the API (uvicorn) and the production worker over
a real SmolLM2 engine, both in process, so real client libraries (openai, LangChain, LiteLLM) can talk to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import uvicorn

from api.app import create_app
from api.http_limits import uvicorn_options
from shared.config import Settings
from shared.launcher.redis_server import RedisServer, free_port
from tests.worker.scripted_engine import InProcessWorker
from worker.engine import Engine
from worker.main import engine_config

MODEL = "smollm2"


@dataclass
class Service:
    base_url: str  # the OpenAI base URL: http://host:port/v1
    model: str = MODEL


@pytest.fixture(scope="module")
def service(redis_server: RedisServer) -> Iterator[Service]:
    if not redis_server.running:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    settings = Settings(redis_url=redis_server.url, model=MODEL, max_num_seqs=8, num_threads=2,
                        lease_ttl_s=30.0, heartbeat_interval_s=1.0)
    worker = InProcessWorker(redis_server.url, settings, worker_id="compat-worker",
                             make_engine=lambda: Engine(engine_config(settings))).start()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=free_port(), log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=2, **uvicorn_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="compat-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "API did not start"
        time.sleep(0.02)
    yield Service(base_url=f"http://127.0.0.1:{config.port}/v1")
    server.should_exit = True
    thread.join(15)
    worker.stop()
