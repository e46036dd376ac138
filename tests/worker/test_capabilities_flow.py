"""A gateway hears which models the nodes can provide, not their heartbeats (issue 22).

Real nats-server; the nodes run Fleet's heartbeat, the sweeper Fleet's duties under its lease
(fleet.worker.sweeper: failover's heartbeat watch and the capability records), the gateway's
catalogue its watches. A model becomes available when a node that can provide it starts and
unavailable when it dies; between, its beats (every field they carry moving: time, held
acks, free memory by less than a step) reach the sweeper and nothing reaches the gateway but
the sweeper's periodic mark. The sweeper's death midway is made good by the next one.

Shortcuts, said: a node dies by its heartbeat key's purge (what the server writes when the
key's TTL passes, 15 s); the sweepers trust an absent key from their start (in a worker only
after its own link has held for a TTL, fleet.worker.liveness)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from fleet.aio import Supervisor, cancel_and_wait
from fleet.capability_rules import MEMORY_STEP
from fleet.gateway.catalogue import Catalogue
from fleet.models.catalog import get_card
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.worker.failover import Failover
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.sweeper import LEASES_BUCKET, SWEEPER, FleetDuties

GB = 1 << 30
WAIT_S = 15.0


class Link:
    """The catalogue's connection, as the gateway's backend gives it."""

    def __init__(self, nc: Client) -> None:
        self.nc: Client | None = nc

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected


class Node:
    """A node's heartbeat (Fleet's), beaten by the test; `sweep()` runs the fleet's duties."""

    def __init__(self, nc: Client, node_id: str, models: list[str]) -> None:
        self.nc, self.node_id = nc, node_id
        self.info = NodeInfo(node_id=node_id, hostname=node_id, memory_total_bytes=64 * GB,
                             memory_available_bytes=16 * GB, cpu_count=2,
                             models_available=models, started_at=time.time(), at=time.time())
        self.beats = 0
        self.duties: FleetDuties | None = None
        self._sweeping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        js = self.nc.jetstream()
        self.nodes = await js.key_value(subjects.NODES_BUCKET)
        self.heartbeat = Heartbeat(self.nc, self.nodes, await js.key_value(
            subjects.RUNNERS_BUCKET), self.node_id, self._beat, list)
        self.heartbeat.held = lambda: [f"$JS.ACK.FLEET_TASKS.x.{self.beats}"]  # moves each beat
        await self.heartbeat.beat()

    def _beat(self) -> NodeInfo:
        self.beats += 1
        wobble = int(MEMORY_STEP * 64 * GB) * (self.beats % 3) // 3  # within a step
        return self.info.model_copy(update={
            "at": time.time(), "memory_available_bytes": 16 * GB - wobble})

    def sweep(self) -> None:
        js = self.nc.jetstream()

        async def duties() -> None:
            failover = Failover(js, self.nodes, await js.key_value(subjects.INSTANCES_BUCKET),
                                {}, self_id=self.node_id, trusted=lambda: True)
            self.duties = FleetDuties(js, self.node_id, failover)
            await self.duties.forever()

        self._sweeping = asyncio.create_task(duties())

    async def stop_sweeping(self) -> None:
        """The sweeper's process gone: its duties stop, and its lease is freed (as the
        sentinel frees a dead holder's, fleet.worker.sweeper._free_leases_of)."""
        assert self._sweeping is not None
        await cancel_and_wait([self._sweeping])
        leases = await self.nc.jetstream().key_value(LEASES_BUCKET)
        await leases.purge(SWEEPER)

    async def die(self) -> None:
        await self.nodes.purge(self.node_id)


Fleet = Callable[[str, list[str]], Awaitable[Node]]


@pytest.fixture
async def fleet(nats_url: str, provisioned_nc: Client) -> AsyncIterator[Fleet]:
    """Starts nodes, each with a connection of its own; stops them after the test."""
    made: list[Node] = []

    async def start(node_id: str, models: list[str]) -> Node:
        node = Node(await nats.connect(nats_url), node_id, models)
        made.append(node)
        await node.start()
        return node

    try:
        yield start
    finally:
        for node in made:
            if node._sweeping is not None:
                await cancel_and_wait([node._sweeping])
            with contextlib.suppress(Exception):
                await node.nc.close()


@pytest.fixture
async def catalogue(nats_url: str, provisioned_nc: Client, tmp_path: Path
                    ) -> AsyncIterator[tuple[Catalogue, Client]]:
    nc = await nats.connect(nats_url, name="gateway")
    catalogue = Catalogue(tmp_path, Link(nc))
    try:
        async with Supervisor("test gateway") as owner:
            try:
                await catalogue.start(owner, WAIT_S)
                yield catalogue, nc
            finally:
                await owner.cancel_all()  # the watches run until cancelled
    finally:
        await nc.close()


def _why(catalogue: Catalogue) -> str | None:
    return catalogue.unavailable(get_card("tiny-llm"))


async def test_a_gateway_hears_a_model_come_and_go_and_no_heartbeat(
    fleet: Fleet, catalogue: tuple[Catalogue, Client],
) -> None:
    gateway, gateway_nc = catalogue
    sweeper = await fleet("sweeper-node", [])
    sweeper.sweep()
    await gateway.until(lambda: "no live node can provide tiny-llm (sweeper-node)"
                        in (_why(gateway) or ""), WAIT_S)

    node = await fleet("n1", ["tiny-llm"])  # a node that can provide it starts
    await gateway.until(lambda: _why(gateway) is None, WAIT_S)

    # Beats, every field moving: the sweeper hears each, the gateway none.
    heard = gateway_nc.stats["in_msgs"]
    started = time.monotonic()
    for _ in range(20):
        await node.heartbeat.beat()
        await sweeper.heartbeat.beat()
    assert sweeper.duties is not None
    failover = sweeper.duties.failover
    # The fence: a change the gateway reads, beaten last; the sweeper writes in order, so
    # once the gateway has it every beat before it has been through the sweeper.
    node.info = node.info.model_copy(update={"models_on_disk": ["tiny-llm"]})
    await node.heartbeat.beat()
    await gateway.until(lambda: any(n.models_on_disk for n in gateway.nodes), WAIT_S)
    assert failover.live["n1"].models_on_disk == ["tiny-llm"]
    window = time.monotonic() - started
    sent = gateway_nc.stats["in_msgs"] - heard
    # the fence's record, and the keeper's mark every 5 s (fleet.capability_rules.KEEPER_S)
    assert sent <= 1 + int(window / 5.0) + 1, (sent, window)
    assert node.beats + sweeper.beats > 40

    await node.die()  # its heartbeat key gone: the model is unavailable
    await gateway.until(lambda: "no live node can provide tiny-llm (sweeper-node)"
                        in (_why(gateway) or ""), WAIT_S)


async def test_a_node_dead_while_no_sweeper_runs_goes_when_the_next_takes_over(
    fleet: Fleet, catalogue: tuple[Catalogue, Client],
) -> None:
    gateway, _ = catalogue
    first = await fleet("first", [])
    first.sweep()
    node = await fleet("n2", ["tiny-llm"])
    await gateway.until(lambda: _why(gateway) is None, WAIT_S)

    await first.stop_sweeping()
    await node.die()  # nobody sweeps: the record stays for now
    second = await fleet("second", [])
    second.sweep()  # takes the lease, reads the bucket and the heartbeats afresh
    await gateway.until(lambda: "no live node can provide tiny-llm" in (_why(gateway) or ""),
                        WAIT_S)
    assert {n.node_id for n in gateway.nodes} == {"first", "second"}
