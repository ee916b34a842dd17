"""The supervisor of ``tokenspool up`` (``shared.launcher.up``): child processes watched, restarted, stopped in order.

Stop (Ctrl-C, SIGTERM, SIGHUP, or a child dying): SIGTERM the workers so they drain, then the API, then Redis.
A process group still alive after its timeout gets SIGKILL; a second Ctrl-C sends it at once. Children also get
SIGTERM from the kernel if the supervisor itself is killed, so nothing is left orphaned.
A worker that dies unexpectedly is reported and restarted after a backoff, up to a crash-loop limit
(``shared.launcher.restart_policy``); the API and Redis stay up meanwhile, and the dead worker's jobs go back to
the queue when their leases expire. The API or Redis dying, or a worker's crash loop, shuts everything down (queued and
running jobs are safe in Redis: they resume on the next start).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from shared.launcher.redis_server import RedisServer
from shared.launcher.restart_policy import CrashHistory, RestartPolicy

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class ChildSpec:
    """A process to supervise: a name for messages, its argv and environment, and how long SIGTERM may take."""

    name: str
    argv: list[str]
    env: dict[str, str]
    stop_timeout_s: float


class ParentDeathSignal:
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
    to a crash-loop limit: ``shared.launcher.restart_policy``), and stops them in order."""

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
        proc = subprocess.Popen(spec.argv, env=spec.env, start_new_session=True, preexec_fn=ParentDeathSignal())
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
