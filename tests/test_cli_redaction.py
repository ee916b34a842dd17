"""``tokenspool config show`` prints the effective settings with the secrets masked (API keys, Redis password)."""

from __future__ import annotations

import json

import pytest

from shared.launcher.cli import main, redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@db.example:6380/2", "redis://:***@db.example:6380/2"),
    ("rediss://alice:s3cret@db.example:6380", "rediss://alice:***@db.example:6380"),
    ("redis://db.example:6379/0?password=s3cret&socket_timeout=5", "redis://db.example:6379/0?password=***&socket_timeout=5"),
    ("unix://:s3cret@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redis_passwords_are_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_config_show_masks_api_keys_and_the_redis_password(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TOKENSPOOL_API_KEYS", "key-one-secret,key-two-secret")
    monkeypatch.setenv("TOKENSPOOL_REDIS_URL", "redis://user:hunter2@cache:6379/0")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "secret" not in out and "hunter2" not in out
    shown = json.loads(out)
    assert shown["api_keys"] == ["***", "***"]
    assert shown["redis_url"] == "redis://user:***@cache:6379/0"
    assert shown["max_num_seqs"] == 64  # everything else as it is
