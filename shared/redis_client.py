"""One way to open Redis from a URL: a single node (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster.

A cluster URL names one or more startup nodes, comma-separated, with the scheme ``redis+cluster://`` (or
``rediss+cluster://`` for TLS); credentials and query options are written once and apply to every node::

    redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
    rediss+cluster://user:PASSWORD@node-a:6380,node-b:6380?ssl_ca_certs=/etc/redis-ca/ca.crt

The client discovers the rest of the cluster from whichever startup node answers, and refuses to run while some
slot has no master (``require_full_coverage``), so a half-configured cluster fails loudly instead of partly.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult, urlsplit

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
    kwargs.update(options)
    kwargs.setdefault("require_full_coverage", True)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in startup_nodes], **kwargs)


def _redacted(parts: SplitResult) -> str:
    """The URL without its password, for error messages."""
    hosts = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{hosts}{parts.path}"
