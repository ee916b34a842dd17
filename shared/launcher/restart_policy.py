"""When ``tokenspool up`` restarts a crashed worker: exponential backoff, and a crash-loop limit.

A worker that dies is restarted after ``backoff_s`` (1 s, 2 s, 4 s ... up to ``max_backoff_s``); a worker that
then runs for ``stable_after_s`` counts as healthy again and its backoff starts over. More than ``max_crashes``
crashes of one worker within ``window_s`` is a crash loop: restarting would only hide the fault, so the
supervisor gives up and stops the stack (the jobs are safe in Redis, and a poison job is already isolated by
the queue, so a loop means something else is wrong: the model, the machine, the configuration).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    max_crashes: int = 5
    window_s: float = 300.0


@dataclass
class CrashHistory:
    """One worker's crashes (``time.monotonic()`` values) and when it was last started."""

    policy: RestartPolicy
    crashes: list[float] = field(default_factory=list)
    started_at: float = 0.0
    consecutive: int = 0  # crashes since it last ran for ``stable_after_s``

    def record_crash(self, now: float) -> float | None:
        """Note a crash at ``now``; returns when to restart it, or None when this is a crash loop (give up)."""
        if now - self.started_at >= self.policy.stable_after_s:
            self.consecutive = 0
        self.consecutive += 1
        self.crashes = [t for t in self.crashes if now - t < self.policy.window_s] + [now]
        if len(self.crashes) > self.policy.max_crashes:
            return None
        delay = min(self.policy.backoff_s * 2.0 ** (self.consecutive - 1), self.policy.max_backoff_s)
        return now + delay

    def started(self, now: float) -> None:
        self.started_at = now
