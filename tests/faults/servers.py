"""Real nats-servers to hurt: one node, or a 3-node JetStream cluster made from the shipped
ops/nats/cluster-N.conf (ports and stores moved to free ports and temp dirs), each server a
process the tests can SIGKILL, restart on the same store and port, SIGSTOP and SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import orjson
from nats.aio.client import Client
from nats.errors import Error as NatsError

from fleet.bus.embedded import EmbeddedNats, ops_dir
from tests.ports import free_port


@dataclass
class NatsNode:
    """One nats-server process; `port` stays fixed after the first start so clients find it."""

    name: str
    store_dir: Path
    log_file: Path
    config: Path | None = None
    port: int = 0
    http_port: int | None = None  # the monitoring port (cluster nodes), for /connz
    server: EmbeddedNats | None = None
    paused: bool = False

    def named_urls(self) -> list[tuple[str, str]]:
        return [(name, node.url) for name, node in self.nodes.items()]

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.server and self.server.process
        return self.server.process.pid

    def start(self) -> NatsNode:
        self.server = EmbeddedNats(
            self.store_dir, port=self.port, config=self.config, log_file=self.log_file
        ).start()
        self.port = self.server.port
        return self

    def running(self) -> bool:
        return bool(self.server and self.server.process and self.server.process.poll() is None)

    def kill(self) -> None:
        """SIGKILL, as a power loss: no goodbye to clients or to the other servers."""
        assert self.server and self.server.process
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing, as behind a partition."""
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.paused:
            self.resume()
        if self.server:
            self.server.stop()


def cluster_config(index: int, target: Path, routes: list[int], http_port: int) -> Path:
    """ops/nats/cluster-<index>.conf with its loopback ports moved to free ones, so the test
    runs the configuration a user copies, beside any other server on this machine."""
    text = (ops_dir() / "nats" / f"cluster-{index}.conf").read_text()
    for shipped, port in zip((6221, 6222, 6223), routes, strict=True):
        text = text.replace(f"127.0.0.1:{shipped}", f"127.0.0.1:{port}")
    text = re.sub(r"http_port:\s*\d+", f"http_port: {http_port}", text)
    # EmbeddedNats gives the store as -sd; the server refuses a second store_dir in the file.
    text = re.sub(r'\n\s*store_dir:\s*"[^"]*"', "", text)
    target.write_text(text)
    return target


@dataclass
class Broker:
    """The servers of one test: a single node, or a cluster keyed by server name."""

    nodes: dict[str, NatsNode] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes.values()]

    def named_urls(self) -> list[tuple[str, str]]:
        return [(name, node.url) for name, node in self.nodes.items()]

    @property
    def url(self) -> str:
        """The comma-separated list FLEET_NATS_URL takes."""
        return ",".join(self.urls)

    @classmethod
    def single(cls, root: Path) -> Broker:
        node = NatsNode("single", root / "n1", root / "n1.log")
        return cls({node.name: node.start()})

    @classmethod
    def cluster(cls, root: Path) -> Broker:
        routes = [free_port() for _ in range(3)]
        nodes: dict[str, NatsNode] = {}
        for index in (1, 2, 3):
            store = root / f"n{index}"
            store.mkdir(parents=True, exist_ok=True)
            http_port = free_port()
            config = cluster_config(index, root / f"n{index}.conf", routes, http_port)
            nodes[f"fleet-n{index}"] = NatsNode(
                f"fleet-n{index}", store, root / f"n{index}.log", config=config,
                http_port=http_port,
            )
        for node in nodes.values():
            node.start()
        return cls(nodes)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    async def restart(self, node: NatsNode) -> None:
        """Start a killed server again on its port and store (blocking start off the loop)."""
        await asyncio.to_thread(node.start)


async def connect_client(broker: Broker, avoid: str | None = None) -> Client:
    """The test's own client: every server (but `avoid`), reconnecting for ever (never the
    code under test)."""

    async def quiet(exc: Exception) -> None:
        """Refused connects while a server is down are the fault itself, not news."""

    return await nats.connect(
        servers=[url for name, url in broker.named_urls() if name != avoid], name="fault-test",
        max_reconnect_attempts=-1, error_cb=quiet,
        reconnect_time_wait=0.25, connect_timeout=5, ping_interval=2, max_outstanding_pings=2,
    )


async def api(nc: Client, subject: str, timeout: float = 2.0) -> dict[str, object]:
    reply = await nc.request(f"$JS.API.{subject}", b"", timeout=timeout)
    return orjson.loads(reply.data)


async def until_jetstream(nc: Client, streams: tuple[str, ...] = (), timeout: float = 60.0) -> None:
    """JetStream answers (a meta leader exists) and each named stream has a leader.

    A request either answers or times out, so each try is bounded; the pause between tries
    only paces a question to a server that is electing."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            info = await api(nc, "INFO")
            last = info.get("error")
            if last is None and all([await leader_of(nc, s) for s in streams]):
                return
        except (NatsError, TimeoutError) as exc:
            last = exc
        await asyncio.sleep(0.25)
    raise TimeoutError(f"JetStream not ready with leaders for {streams}: {last!r}")


async def clients_named(node: NatsNode, name: str) -> int | None:
    """How many clients called `name` this server holds (its /connz), None if unknown: shows
    whether a fault cut workers off or only the servers' RAFT groups."""
    if node.http_port is None:
        return None
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            reply = await http.get(f"http://127.0.0.1:{node.http_port}/connz?limit=1024")
        return sum(c.get("name") == name for c in reply.json().get("connections") or [])
    except (httpx.HTTPError, ValueError):
        return None


async def leader_of(nc: Client, stream: str) -> str | None:
    """The server name leading a stream's RAFT group (None while it elects)."""
    info = await api(nc, f"STREAM.INFO.{stream}")
    cluster = info.get("cluster") or {}
    assert isinstance(cluster, dict)
    leader = cluster.get("leader")
    return str(leader) if leader else None


async def move_leader(nc: Client, stream: str, server: str, timeout: float = 20.0) -> bool:
    """Ask the stream's leader to step down in favour of `server` (a preferred placement);
    True once `server` leads. Each question is a bounded request; the pause paces them."""
    body = orjson.dumps({"placement": {"preferred": server}})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(NatsError, TimeoutError):
            if await leader_of(nc, stream) == server:
                return True
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=2.0)
        await asyncio.sleep(0.5)
    return False


async def replicas_of(nc: Client, stream: str) -> int:
    info = await api(nc, f"STREAM.INFO.{stream}")
    config = info.get("config") or {}
    assert isinstance(config, dict)
    return int(config.get("num_replicas", 1))


async def consumer_leader(nc: Client, stream: str, consumer: str) -> str | None:
    info = await api(nc, f"CONSUMER.INFO.{stream}.{consumer}")
    cluster = info.get("cluster") or {}
    assert isinstance(cluster, dict)
    leader = cluster.get("leader")
    return str(leader) if leader else None


async def meta_leader(broker: Broker, timeout: float = 30.0) -> str | None:
    """The server leading the JetStream meta group (its API), from a server's /jsz; None
    when none says so within `timeout` (an election)."""
    deadline = time.monotonic() + timeout
    while (leader := await _said_meta_leader(broker)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.25)  # paces the question while the cluster elects
    return leader


async def _said_meta_leader(broker: Broker) -> str | None:
    for node in broker.nodes.values():
        if node.http_port is None:
            continue
        with contextlib.suppress(httpx.HTTPError, ValueError):
            async with httpx.AsyncClient(timeout=2.0) as http:
                reply = await http.get(f"http://127.0.0.1:{node.http_port}/jsz")
            leader = (reply.json().get("meta_cluster") or {}).get("leader")
            if leader:
                return str(leader)
    return None


async def leaders_off(
    nc: Client, broker: Broker, server: str, keep: tuple[str, ...], timeout: float = 30.0
) -> None:
    """Every stream and replicated consumer group led by `server`, but those of the streams in
    `keep`, steps down until another server leads it: a fault on `server` then hurts only
    `keep` (and the one-replica consumers it hosts, such as some KV watchers: they cannot
    move, and recreate themselves elsewhere).
    The meta group's leader cannot be moved without the system account: pick a `server`
    that does not lead it (`meta_leader`)."""
    deadline = time.monotonic() + timeout
    assert await meta_leader(broker) != server, f"{server} leads the meta group"
    names = await api(nc, "STREAM.NAMES")
    streams = [str(name) for name in names.get("streams") or [] if name not in keep]
    groups: list[tuple[str, str]] = [(f"STREAM.INFO.{s}", f"STREAM.LEADER.STEPDOWN.{s}")
                                     for s in streams]
    for stream in streams:
        consumers = await api(nc, f"CONSUMER.NAMES.{stream}")
        groups += [(f"CONSUMER.INFO.{stream}.{c}", f"CONSUMER.LEADER.STEPDOWN.{stream}.{c}")
                   for c in consumers.get("consumers") or []]
    for info_api, stepdown_api in groups:
        while True:
            with contextlib.suppress(NatsError, TimeoutError):
                cluster = (await api(nc, info_api)).get("cluster") or {}
                assert isinstance(cluster, dict)
                if cluster.get("leader") not in (server, None) or not cluster.get("replicas"):
                    break  # led elsewhere, or a one-replica consumer (a watcher): it stays
                await api(nc, stepdown_api)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{info_api}: still led by {server}")
            await asyncio.sleep(0.5)
