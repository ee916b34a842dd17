"""``tokenspool up``: Redis, the API and N workers as one foreground service (the supervisor is
``shared.launcher.supervisor``).

Start: prepare the model first (so workers don't race converting it), start the embedded Redis unless a Redis
URL is configured (AOF in ``data_dir``; the port is remembered there so it stays the same across runs), then the
API and the workers, each as a child process in its own process group, and wait until they are healthy.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from shared.config import Settings
from shared.launcher.redis_server import RedisServer, find_redis_server, free_port
from shared.launcher.supervisor import ChildSpec, ParentDeathSignal, Supervisor

API_STOP_TIMEOUT_S = 10.0
WORKER_EXIT_GRACE_S = 15.0  # on top of drain_timeout_s: releasing unfinished jobs and exiting
STARTUP_TIMEOUT_S = 60.0


def settings_env(settings: Settings) -> dict[str, str]:
    """Settings as ``TOKENSPOOL_*`` variables, so a child process rebuilds exactly the same Settings.

    Unset (None) fields map to an empty string, meaning "remove this variable from the child's environment".
    """
    env: dict[str, str] = {}
    for field, value in settings.model_dump().items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = ",".join(value)
        else:
            text = "" if value is None else str(value)
        env[f"TOKENSPOOL_{field.upper()}"] = text
    return env


def _child_env(settings: Settings, **overrides: str | None) -> dict[str, str]:
    merged = {**settings_env(settings), **{f"TOKENSPOOL_{k.upper()}": v or "" for k, v in overrides.items()}}
    env = {key: value for key, value in os.environ.items() if key not in merged}
    env.update({key: value for key, value in merged.items() if value})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def child_specs(settings: Settings, redis_url: str, port: int) -> tuple[ChildSpec, list[ChildSpec]]:
    """The API and worker processes of ``tokenspool up``: ``python -m shared.launcher.cli api|worker``."""
    cli = [sys.executable, "-m", "shared.launcher.cli"]
    api = ChildSpec("api", [*cli, "api"], _child_env(settings, redis_url=redis_url, port=str(port)),
                    API_STOP_TIMEOUT_S)
    workers = []
    for i in range(settings.workers):
        # Each worker needs its own id and metrics port: derive them from the configured ones.
        worker_id = f"{settings.worker_id}-{i}" if settings.worker_id and settings.workers > 1 else settings.worker_id
        metrics = settings.metrics_port + i if settings.metrics_port else settings.metrics_port
        env = _child_env(settings, redis_url=redis_url, worker_id=worker_id,
                         metrics_port=None if metrics is None else str(metrics))
        workers.append(ChildSpec(f"worker-{i}", [*cli, "worker"], env,
                                 settings.drain_timeout_s + WORKER_EXIT_GRACE_S))
    return api, workers


def _ensure_port_free(host: str, port: int) -> None:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise SystemExit(f"tokenspool up: cannot listen on {host}:{port} ({exc.strerror}); "
                             "pass --port or set TOKENSPOOL_PORT") from exc


@contextmanager
def _exclusive(data_dir: Path) -> Iterator[None]:
    """Hold a lock on ``data_dir`` so two ``tokenspool up`` never share one Redis AOF."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "up.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise SystemExit(f"tokenspool up: another `tokenspool up` is using {data_dir}; stop it first "
                             "or pass --data-dir") from exc
        yield


def _redis_port(data_dir: Path) -> int:
    """The port used last time with this data dir if it is free now, else a free one (remembered)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    remembered = data_dir / "redis.port"
    try:
        port = int(remembered.read_text())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    except (OSError, ValueError):
        port = free_port()
    remembered.write_text(f"{port}\n")
    return port


def _http_ok(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _throttled(check: Callable[[], bool], interval_s: float) -> Callable[[], bool]:
    """``check`` run at most once per ``interval_s`` (False in between), so polling doesn't flood access logs."""
    last = [float("-inf")]

    def throttled() -> bool:
        if time.monotonic() - last[0] < interval_s:
            return False
        last[0] = time.monotonic()
        return check()

    return throttled


def _banner(settings: Settings, base_url: str, redis_url: str, embedded: bool) -> str:
    auth = " -H 'authorization: Bearer <api key>'" if settings.api_keys else ""
    where = f"embedded, data in {settings.data_dir / 'redis'}" if embedded else "external"
    return "\n".join([
        "tokenspool is up",
        f"  API      {base_url}   (OpenAPI docs: {base_url}/docs)",
        f"  Console  {base_url}/ui   (playground, your jobs, the fleet)",
        f"  Redis    {redis_url}   ({where})",
        f"  Workers  {settings.workers} x {settings.served_model_name} (jobs wait in the queue while they load)",
        "Try:",
        f"  curl -s {base_url}/v1/jobs{auth} -H 'content-type: application/json' \\",
        "       -d '{\"prompt\": \"The capital of France is\", \"max_tokens\": 32}'",
        f"  curl -sN {base_url}/v1/jobs/<id>/events{auth}",
        "Ctrl-C stops everything (workers finish or hand back their jobs first).",
    ])


def _prepare_models(settings: Settings) -> None:
    """Convert the model (and draft model) once, here, so N workers starting together don't race to do it."""
    from worker.models import resolve_model

    for model in filter(None, (settings.model, settings.draft_model)):
        print(f"preparing model {model} ...", flush=True)
        print(f"  {resolve_model(model, settings.model_cache_dir)}", flush=True)


def run_up(settings: Settings) -> int:
    """Run ``tokenspool up`` in the foreground until Ctrl-C/SIGTERM (exit 0) or a child's death (exit 1)."""
    port = settings.port or free_port()
    _ensure_port_free(settings.host, port)
    embedded = settings.redis_url is None
    try:
        if settings.workers:
            _prepare_models(settings)
        redis_binary = find_redis_server() if embedded else None
    except FileNotFoundError as exc:  # ModelNotFoundError too: the message says how to install what is missing
        print(f"tokenspool up: {exc}", file=sys.stderr)
        return 1
    with _exclusive(settings.data_dir) if embedded else nullcontext():
        redis = None
        if embedded:  # the same folder as `tokenspool api`'s embedded Redis, so both see one queue
            redis_dir = settings.data_dir / "redis"
            redis = RedisServer(redis_dir, port=_redis_port(redis_dir), binary=redis_binary, detached=True,
                                preexec_fn=ParentDeathSignal())
        redis_url = redis.url if redis is not None else str(settings.redis_url)
        api, workers = child_specs(settings, redis_url, port)
        supervisor = Supervisor(api, workers, redis)
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in handled}
        try:
            supervisor.start()
            host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
            base_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            healthy = _throttled(lambda: _http_ok(f"{base_url}/healthz"), interval_s=0.5)
            code = supervisor.wait(until=healthy, timeout_s=STARTUP_TIMEOUT_S)
            if code is not None:
                return code
            print(_banner(settings, base_url, redis_url, embedded), flush=True)
            if settings.workers:
                code = supervisor.wait(until=_throttled(lambda: _http_ok(f"{base_url}/readyz"), interval_s=1.0))
                if code is not None:
                    return code
                print(f"tokenspool: ready ({base_url}/readyz: a worker serves {settings.served_model_name})",
                      flush=True)
            return supervisor.wait() or 0
        finally:
            drain = f"workers finish their running jobs for up to {settings.drain_timeout_s:.0f} s, " \
                if settings.workers else ""
            print(f"tokenspool: stopping ({drain}then the API and Redis; Ctrl-C again stops everything at once) ...",
                  flush=True)
            supervisor.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            print("tokenspool: stopped", flush=True)
