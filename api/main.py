"""``tokenspool api``: serve the API with uvicorn (the CLI calls ``run_api``)."""

from __future__ import annotations

import contextlib
import logging

import uvicorn

from api.app import create_app
from api.http_limits import uvicorn_options
from shared.config import Settings, no_tokenizer_thread_pool
from shared.launcher.redis_server import RedisServer

log = logging.getLogger(__name__)


def run_api(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM. Without ``redis_url``, start an embedded redis-server (AOF in ``data_dir``)
    for the lifetime of the API and point the app at it."""
    no_tokenizer_thread_pool()
    with contextlib.ExitStack() as stack:
        if settings.redis_url is None:
            server = stack.enter_context(RedisServer(settings.data_dir / "redis"))
            log.info("no redis_url configured: started an embedded redis-server at %s", server.url)
            settings = settings.model_copy(update={"redis_url": server.url})
        app = create_app(settings)
        # log_config=None: uvicorn keeps its hands off logging, so its lines go through our JSON handler.
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                    log_config=None,
                    # Streams are long-lived; let shutdown wait a little for them, then cancel (and so cancel
                    # their jobs unless they run in the background).
                    timeout_graceful_shutdown=5,
                    # Request heads bounded in size and time (api/http_limits.py).
                    **uvicorn_options(settings))
