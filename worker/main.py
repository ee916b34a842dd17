"""The worker process: load the engine, connect to Redis, serve jobs until SIGTERM/SIGINT, exit 0 after a drain.

``run_worker(settings)`` is the entry of ``tokenspool worker`` and ``python -m worker`` (settings from the
``TOKENSPOOL_*`` environment there).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable

import transformers

from shared.config import Settings, no_tokenizer_thread_pool
from shared.logging_setup import configure_logging
from shared.queue import JobQueue
from shared.redis_client import open_client
from worker.engine import Engine, EngineConfig
from worker.engine_thread import EngineThread
from worker.metrics import WorkerMetrics
from worker.runner import Runner

log = logging.getLogger(__name__)


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's settings; "auto" device/dtype/kv_cache_dtype become None (the engine picks)."""
    return EngineConfig(
        model=settings.model, block_size=settings.block_size, num_kv_blocks=settings.num_kv_blocks,
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_bytes=settings.kv_cache_bytes, device=None if settings.device == "auto" else settings.device,
        dtype=None if settings.dtype == "auto" else settings.dtype,
        enable_prefix_caching=settings.enable_prefix_caching,
        speculative_method=settings.speculative, draft_model=settings.draft_model,
        num_speculative_tokens=settings.num_speculative_tokens,
        speculative_max_batch=settings.speculative_max_batch, quantization=settings.quantization,
        attention_backend=settings.attention_backend, async_scheduling=settings.async_scheduling,
        kv_cache_dtype=None if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype,
        # Default: one torch thread per core this process may run on (torch's own default counts the machine's
        # cores, which oversubscribes a pinned or shared worker; docs/performance.md).
        num_threads=settings.num_threads or len(os.sched_getaffinity(0)),
    )


def default_worker_id() -> str:
    """``host-pid-random``: unique even when a restarted worker reuses a pid."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def run_worker(settings: Settings, make_engine: Callable[[EngineConfig], Engine] = Engine) -> int:
    """Serve ``settings.served_model_name`` from the Redis at ``settings.redis_url``; returns the exit code.

    ``make_engine`` builds the engine from its config (tests pass an engine with a fault built in)."""
    no_tokenizer_thread_pool()
    configure_logging(settings.log_level)
    if settings.redis_url is None:
        log.error("a worker needs TOKENSPOOL_REDIS_URL (or --redis-url): the Redis its API uses")
        return 2
    worker_id = settings.worker_id or default_worker_id()
    log.info("worker %s loading model %s", worker_id, settings.model)
    # Weight loading's tqdm bars would interleave raw text with our JSON log lines.
    transformers.utils.logging.disable_progress_bar()
    engine_thread = EngineThread()
    engine = engine_thread.build(lambda: make_engine(engine_config(settings)))
    metrics = WorkerMetrics(settings.served_model_name)
    if settings.metrics_port is not None:
        # Only once the model is loaded: the port answering is what the orchestrator's probes wait for.
        server = metrics.serve(settings.metrics_port)
        log.info("worker %s metrics on port %d", worker_id, server.server_port,
                 extra={"worker_id": worker_id, "metrics_port": server.server_port})
    return asyncio.run(_serve(settings, engine, engine_thread, worker_id, metrics))


async def _serve(settings: Settings, engine: Engine, engine_thread: EngineThread, worker_id: str,
                 metrics: WorkerMetrics) -> int:
    assert settings.redis_url is not None
    redis = await open_client(settings.redis_url, socket_connect_timeout=5, health_check_interval=15)
    runner = Runner(engine, engine_thread, JobQueue(redis, settings), settings, worker_id, metrics=metrics)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runner.request_stop)
    log.info("worker %s serving model %s (max_num_seqs %d, max_model_len %d)", worker_id,
             settings.served_model_name, settings.max_num_seqs, engine.max_model_len)
    try:
        code = await runner.run()
    finally:
        await redis.aclose()
    log.info("worker %s stopped (exit %d)", worker_id, code)
    return code
