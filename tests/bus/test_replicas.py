"""Replicas follow the cluster: 3 on a 3-node loopback cluster, 1 on a single server, the
override wins, and an existing R1 stream in a cluster is reported with the command that
raises it. Results are read back with nats-py's own JetStream API."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.connect import connect
from fleet.bus.embedded import EmbeddedNats
from fleet.bus.provision import definitions, provision
from fleet.bus.replicas import advice, choose_replicas, pick_replicas
from fleet.wire import subjects
from tests.bus.cluster import cluster_config, nats_cluster
from tests.ports import free_port


@pytest.mark.parametrize(("override", "clustered", "holds_three", "chosen"), [
    (0, False, False, 1),
    (0, True, False, 1),
    (0, True, True, 3),
    (1, True, True, 1),
    (5, False, False, 5),
])
def test_pick_replicas(override: int, clustered: bool, holds_three: bool, chosen: int) -> None:
    assert pick_replicas(override, clustered, holds_three) == chosen


def test_advice_names_the_command_that_raises_replicas() -> None:
    assert advice("FLEET_OUT", 3, 3) is None
    text = advice("FLEET_OUT", 1, 3)
    assert text is not None and "`nats stream edit FLEET_OUT --replicas 3`" in text


async def replicas_of(nc: Client) -> dict[str, int]:
    js = nc.jetstream()
    return {
        d["name"]: (await js.stream_info(d["name"])).config.num_replicas or 1
        for d in definitions()
    }


async def test_a_single_server_gets_one_replica(provisioned_nc: Client) -> None:
    assert await choose_replicas(provisioned_nc) == 1
    assert set((await replicas_of(provisioned_nc)).values()) == {1}


@pytest.mark.timeout(120)
async def test_a_three_node_cluster_gets_three_replicas_and_r1_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with nats_cluster(tmp_path) as servers:
        nc = await connect([s.url for s in servers], "test-replicas")
        try:
            # The override: one copy, as asked.
            await provision(nc, replicas=1)
            assert set((await replicas_of(nc)).values()) == {1}
            # Provisioning again from the cluster's size keeps them and says how to raise them.
            with caplog.at_level(logging.WARNING, logger="fleet.bus.provision"):
                await provision(nc)
            warned = " ".join(r.getMessage() for r in caplog.records)
            assert f"nats stream edit {subjects.OUT_STREAM} --replicas 3" in warned
            # From scratch, the cluster's size picks three.
            js = nc.jetstream()
            for d in definitions():
                await js.delete_stream(d["name"])
            assert await choose_replicas(nc) == 3
            outcomes = await provision(nc)
            assert {o.action for o in outcomes} == {"created"}
            assert set((await replicas_of(nc)).values()) == {3}
        finally:
            await nc.close()


class Heard(logging.Handler):
    """Sets an event when a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def growing_cluster(root: Path) -> list[EmbeddedNats]:
    """Two clustered servers that know only each other, and a third (not started) that
    routes to both: a cluster whose last server has not joined yet."""
    ports = [free_port() for _ in range(3)]
    servers = []
    for index in range(3):
        config = root / f"n{index}.conf"
        routes = ports if index == 2 else ports[:2]
        config.write_text(cluster_config(f"n{index}", ports[index], routes))
        servers.append(EmbeddedNats(root / f"n{index}", port=free_port(), config=config,
                                    log_file=root / f"n{index}.log"))
    return servers


@pytest.mark.timeout(120)
async def test_provisioning_waits_for_the_last_server_of_a_forming_cluster(
    tmp_path: Path,
) -> None:
    """Before a cluster's third server joins, JetStream cannot place three copies ("no
    suitable peers for placement"): provisioning waits for it instead of failing."""
    heard = Heard("waiting up to")
    provision_log = logging.getLogger("fleet.bus.provision")
    provision_log.addHandler(heard)
    servers = growing_cluster(tmp_path)
    try:
        for server in servers[:2]:
            server.start()
        nc = await connect([s.url for s in servers[:2]], "test-placement")
        provisioning = asyncio.create_task(provision(nc, replicas=3))
        waiting = asyncio.create_task(heard.event.wait())
        await asyncio.wait({provisioning, waiting}, timeout=60,
                           return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert heard.event.is_set() and not provisioning.done()
        servers[2].start()
        await asyncio.wait_for(provisioning, timeout=60)
        assert set((await replicas_of(nc)).values()) == {3}
        await nc.close()
    finally:
        provision_log.removeHandler(heard)
        for server in servers:
            server.stop()
