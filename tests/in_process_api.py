"""A real uvicorn serving ``create_app(settings)`` in a thread, on a free port: the API as the API tests and the
client-compatibility tests run it (a real server, since streaming and real clients need one)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import uvicorn

from api.app import create_app
from api.http_limits import uvicorn_options
from shared.config import Settings
from shared.launcher.redis_server import free_port


@dataclass
class ApiServer:
    settings: Settings
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread
    openai_clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self, api_key: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30, **kwargs)

    def openai_client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        """The official client on this API (no retries unless asked), closed by ``stop``: a client left to the
        garbage collector can drop its pooled socket first, and that ResourceWarning fails whichever test is
        running then."""
        options: dict[str, Any] = {"max_retries": 0, "timeout": 30} | kwargs
        client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, **options)
        self.openai_clients.append(client)
        return client

    def stop(self) -> None:
        for client in self.openai_clients:
            client.close()
        self.server.should_exit = True
        self.thread.join(15)


def serve_api(settings: Settings, start_timeout_s: float = 10.0) -> ApiServer:
    """Start the API for ``settings`` and return once it accepts connections."""
    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=2, **uvicorn_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"api-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "API did not start"
        time.sleep(0.01)
    return ApiServer(settings, f"http://127.0.0.1:{port}", server, thread)
