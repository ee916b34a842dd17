"""``python -m tests.worker.crashing_worker``: the real worker, whose engine kills its own process (SIGKILL) in
any step while it holds a request whose prompt contains ``CRASH_TOKEN_ID`` — a poison job that takes the whole
worker down, as a native crash in a kernel would. Everything else is production code."""

from __future__ import annotations

import os
import signal

from shared.config import Settings
from worker.engine import Engine, EngineConfig, StepOutput
from worker.main import run_worker

CRASH_TOKEN_ID = 77


class CrashingEngine(Engine):
    """An engine with one built-in fault: a step that holds the crash token dies with the process."""

    def step(self) -> list[StepOutput]:
        if any(CRASH_TOKEN_ID in r.prompt_token_ids for r in self._requests.values()):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step()


def _make(config: EngineConfig) -> Engine:
    return CrashingEngine(config)


if __name__ == "__main__":
    raise SystemExit(run_worker(Settings(), make_engine=_make))
