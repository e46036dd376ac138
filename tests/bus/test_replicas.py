"""Replicas follow the cluster: 3 on a 3-node loopback cluster, 1 on a single server, the
override wins, and an existing R1 stream in a cluster is reported with the command that
raises it. Results are read back with nats-py's own JetStream API."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.connect import connect
from fleet.bus.provision import definitions, provision
from fleet.bus.replicas import advice, choose_replicas, pick_replicas
from fleet.wire import subjects
from tests.bus.cluster import nats_cluster


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
