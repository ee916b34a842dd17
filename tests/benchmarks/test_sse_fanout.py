"""benchmarks/sse_fanout.py at a tiny scale: streams held by several client processes, one pub/sub connection."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sse_fanout import main


def test_streams_split_over_client_processes_share_one_pubsub_connection(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    assert main(["--streams", "40", "--client-processes", "3", "--open-at-once", "9", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["streams"] == 40 and row["client_processes"] == 3 and row["subscribed"] == 40
    assert row["answered_200"] == 40  # every client process held its share open until released
    assert row["redis_pubsub_connections"] == 1
    assert row["api_rss_mib"] > 0 and row["open_s"] > 0
