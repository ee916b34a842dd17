"""``python -m worker``: one worker, configured from the ``TOKENSPOOL_*`` environment."""

from shared.config import Settings
from worker.main import run_worker

raise SystemExit(run_worker(Settings()))
