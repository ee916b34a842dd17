"""One way to open Redis from a URL: a single node (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster.

A cluster URL names one or more startup nodes, comma-separated, with the scheme ``redis+cluster://`` (or
``rediss+cluster://`` for TLS); credentials and query options are written once and apply to every node::

    redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
    rediss+cluster://user:PASSWORD@node-a:6380,node-b:6380?ssl_ca_certs=/etc/redis-ca/ca.crt

The client discovers the rest of the cluster from whichever startup node answers, and refuses to run while some
slot has no master (``require_full_coverage``), so a half-configured cluster fails loudly instead of partly.
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import SplitResult, urlsplit

import redis
import redis.cluster
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_PORT = 6379


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def connect(url: str, **kwargs: Any) -> Redis | RedisCluster:
    """An asyncio client for ``url``: ``RedisCluster`` for a cluster URL, ``Redis`` otherwise.

    ``kwargs`` go to the client (``decode_responses``, ``max_connections``, ...); options in the URL's query
    string win over them, as in redis-py's ``from_url``.
    """
    if is_cluster_url(url):
        return _connect_cluster(url, **kwargs)
    return Redis.from_url(url, **kwargs)


async def open_client(url: str, **kwargs: Any) -> Redis:
    """``connect``, and for a cluster its slot map loaded now (sharded pub/sub needs it before a first command).
    Typed as ``Redis``: a ``RedisCluster`` answers the same commands, which is all the queue code uses."""
    client = connect(url, **kwargs)
    if isinstance(client, RedisCluster):
        await client.initialize()
    return cast(Redis, client)


def connect_sync(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for ``url`` (tools, tests, benchmarks): ``redis.RedisCluster`` for a cluster URL, typed
    as ``redis.Redis`` for the same reason as ``open_client``."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in parse_startup_nodes(url)]  # type: ignore[no-untyped-call]
    return cast(redis.Redis, redis.RedisCluster(startup_nodes=nodes, **_cluster_options(url), **kwargs))


def parse_startup_nodes(url: str) -> list[tuple[str, int]]:
    """The (host, port) pairs of a cluster URL, in order; ValueError when there are none or a port is bad."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    nodes = []
    for address in hosts.split(","):
        host, colon, port = address.strip().rpartition(":")
        if not colon:
            host, port = port, str(DEFAULT_PORT)
        host = host.strip("[]")  # an IPv6 literal is written [::1]:7000
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis_url: bad cluster node {address!r} in {_redacted(parts)}; expected host:port")
        nodes.append((host, int(port)))
    return nodes


def _connect_cluster(url: str, **kwargs: Any) -> RedisCluster:
    kwargs.update(_cluster_options(url))
    kwargs.setdefault("require_full_coverage", True)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in parse_startup_nodes(url)], **kwargs)


def _cluster_options(url: str) -> dict[str, Any]:
    """The client options of a cluster URL (credentials, TLS, query string), parsed once by redis-py."""
    parts = urlsplit(url)
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"redis_url: a cluster has only database 0, got path {parts.path!r}")
    startup_nodes = parse_startup_nodes(url)
    # The first node stands in for all in a plain URL, so redis-py parses credentials and query options once.
    userinfo = parts.netloc.rpartition("@")[0]
    first_host, first_port = startup_nodes[0]
    host = f"[{first_host}]" if ":" in first_host else first_host
    netloc = f"{userinfo}@{host}:{first_port}" if userinfo else f"{host}:{first_port}"
    plain_url = SplitResult(CLUSTER_SCHEMES[parts.scheme.lower()], netloc, "", parts.query, "").geturl()
    options: dict[str, Any] = dict(parse_url(plain_url))
    options.pop("host", None)
    options.pop("port", None)
    if options.pop("connection_class", None) is not None:  # only rediss:// sets it: SSLConnection
        options["ssl"] = True
    return options


def _redacted(parts: SplitResult) -> str:
    """The URL without its password, for error messages."""
    hosts = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{hosts}{parts.path}"
