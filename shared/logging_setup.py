"""Structured logging: one JSON object per line on stderr, for the API and worker processes.

Each line is ``{"ts", "level", "logger", "msg", ...}`` plus any ``extra=`` fields of the call, so
``log.info("job %s done", job_id, extra={"job_id": job_id})`` can be found by ``job_id`` in a log search.
Call :func:`configure_logging` once at process start. Uvicorn should be run with ``log_config=None`` so that
its loggers propagate to the root handler installed here instead of installing their own.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from `extra=` and is emitted as a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

# Loggers that install their own handlers or are chatty at INFO.
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON: ts (ISO 8601, UTC), level, logger, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: an extra field that JSON cannot hold (a Path, an enum) is logged as its str().
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str | int = "INFO", stream: TextIO | None = None) -> None:
    """Send all logging to ``stream`` (stderr by default) as JSON lines at ``level``.

    Replaces any handlers on the root logger, so calling it twice does not duplicate lines.
    Raises ``ValueError`` for an unknown level name.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in _UVICORN_LOGGERS:
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    logging.captureWarnings(True)
