"""``tokenspool up``: Redis, the API and N workers as one foreground service.

Start: prepare the model first (so workers don't race converting it), start the embedded Redis unless a Redis
URL is configured (AOF in ``data_dir``; the port is remembered there so it stays the same across runs), then the
API and the workers, each as a child process in its own process group.
Stop (Ctrl-C, SIGTERM, SIGHUP, or a child dying): SIGTERM the workers so they drain, then the API, then Redis.
A process group still alive after its timeout gets SIGKILL; a second Ctrl-C sends it at once. Children also get
SIGTERM from the kernel if the supervisor itself is killed, so nothing is left orphaned.
A worker that dies unexpectedly is reported and restarted after a backoff, up to a crash-loop limit
(``shared.restart_policy``); the API and Redis stay up meanwhile, and the dead worker's jobs go back to the queue
when their leases expire. The API or Redis dying, or a worker's crash loop, shuts everything down (queued and
running jobs are safe in Redis: they resume on the next start).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import Settings
from shared.redis_server import RedisServer, find_redis_server, free_port
from shared.restart_policy import CrashHistory, RestartPolicy

log = logging.getLogger(__name__)

API_STOP_TIMEOUT_S = 10.0
WORKER_EXIT_GRACE_S = 15.0  # on top of drain_timeout_s: releasing unfinished jobs and exiting
STARTUP_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class ChildSpec:
    """A process to supervise: a name for messages, its argv and environment, and how long SIGTERM may take."""

    name: str
    argv: list[str]
    env: dict[str, str]
    stop_timeout_s: float


class _ParentDeathSignal:
    """A ``preexec_fn``: the child gets SIGTERM when the supervisor dies, even by SIGKILL (Linux only)."""

    def __init__(self) -> None:
        self._parent_pid = os.getpid()
        # Resolved here, not in the forked child, where only async-signal-safe work is allowed.
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def __call__(self) -> None:
        if self._prctl is not None:
            self._prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self._parent_pid:  # the parent died before prctl took effect
            os._exit(1)


class Supervisor:
    """Runs the API and workers (and optionally Redis), watches them, restarts crashed workers (with backoff, up
    to a crash-loop limit: ``shared.restart_policy``), and stops them in order."""

    def __init__(self, api: ChildSpec | None, workers: list[ChildSpec], redis: RedisServer | None = None,
                 poll_interval_s: float = 0.2, restart_policy: RestartPolicy | None = None) -> None:
        self.api = api
        self.workers = workers
        self.redis = redis
        self.poll_interval_s = poll_interval_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.num_signals = 0
        policy = restart_policy or RestartPolicy()
        self.histories = {spec.name: CrashHistory(policy) for spec in workers}
        self.restart_at: dict[str, float] = {}  # crashed workers waiting out their backoff: name -> monotonic time

    def request_stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        """Signal handler: the first signal asks for an orderly stop, the next one for SIGKILL."""
        self.num_signals += 1

    def start(self) -> None:
        if self.redis is not None:
            self.redis.start()
        for spec in ([self.api] if self.api else []) + self.workers:
            self._spawn(spec)

    def _spawn(self, spec: ChildSpec) -> None:
        proc = subprocess.Popen(spec.argv, env=spec.env, start_new_session=True, preexec_fn=_ParentDeathSignal())
        self.procs[spec.name] = proc
        if spec.name in self.histories:
            self.histories[spec.name].started(time.monotonic())
        log.info("started %s (pid %d)", spec.name, proc.pid, extra={"child": spec.name, "pid": proc.pid})

    def dead_child(self) -> str | None:
        """A description of a death that ends the stack: the API's, Redis's, or a worker's crash loop. A crashed
        worker is restarted after its backoff (the API and Redis stay up meanwhile)."""
        if self.api is not None and (proc := self.procs.get(self.api.name)) is not None and proc.poll() is not None:
            return f"{self.api.name} (pid {proc.pid}) exited with code {proc.returncode}"
        if self.redis is not None and not self.redis.running:
            return f"redis-server on port {self.redis.port} exited; see {self.redis.data_dir}/redis.log"
        return self._revive_workers()

    def _revive_workers(self) -> str | None:
        now = time.monotonic()
        for spec in self.workers:
            if spec.name in self.restart_at:
                if now >= self.restart_at[spec.name]:
                    del self.restart_at[spec.name]
                    log.warning("restarting %s", spec.name, extra={"child": spec.name, "event": "restarted"})
                    self._spawn(spec)
                continue
            proc = self.procs.get(spec.name)
            if proc is None or proc.poll() is None:
                continue
            history = self.histories[spec.name]
            when = history.record_crash(now)
            if when is None:
                return (f"{spec.name} (pid {proc.pid}) exited with code {proc.returncode}: "
                        f"{len(history.crashes)} crashes within {history.policy.window_s:.0f} s (a crash loop)")
            log.error("%s (pid %d) exited with code %s unexpectedly; restarting it in %.0f s", spec.name, proc.pid,
                      proc.returncode, when - now,
                      extra={"child": spec.name, "exit_code": proc.returncode, "event": "crashed"})
            self.restart_at[spec.name] = when
        return None

    def wait(self, until: Callable[[], bool] | None = None, timeout_s: float | None = None) -> int | None:
        """Block until a stop signal (0), a child's death (1), ``until()`` holding (None) or the timeout (1)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.num_signals:
            dead = self.dead_child()
            if dead is not None:
                log.error("%s; shutting everything down", dead)
                return 1
            if until is not None and until():
                return None
            if deadline is not None and time.monotonic() > deadline:
                log.error("not ready after %.0f s; shutting everything down", timeout_s)
                return 1
            time.sleep(self.poll_interval_s)
        return 0

    def stop(self) -> None:
        """Stop the workers (they drain), then the API, then Redis. Safe to call more than once."""
        signals_before = self.num_signals
        self._stop_children(self.workers, signals_before)
        self._stop_children([self.api] if self.api else [], signals_before)
        if self.redis is not None:
            self.redis.stop()

    def _stop_children(self, specs: list[ChildSpec], signals_before: int) -> None:
        started = [(spec, self.procs[spec.name]) for spec in specs if spec.name in self.procs]
        for spec, proc in started:
            if proc.poll() is None:
                log.info("stopping %s (pid %d)", spec.name, proc.pid, extra={"child": spec.name, "pid": proc.pid})
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + max((spec.stop_timeout_s for spec, _ in started), default=0.0)
        while any(proc.poll() is None for _, proc in started):
            if time.monotonic() > deadline or self.num_signals > signals_before:
                break
            time.sleep(0.05)
        for spec, proc in started:
            if proc.poll() is None:
                why = "stop requested again" if self.num_signals > signals_before else "did not stop in time"
                log.warning("%s %s: SIGKILL", spec.name, why, extra={"child": spec.name})
            # The whole group, so grandchildren die with their parent even when the parent already exited.
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, sig)


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
    """The API and worker processes of ``tokenspool up``: ``python -m shared.cli api|worker``."""
    cli = [sys.executable, "-m", "shared.cli"]
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
                                preexec_fn=_ParentDeathSignal())
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
