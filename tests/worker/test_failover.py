"""The failover sweep against a real nats-server: it moves only on evidence, never this
node's instances, wins one compare-and-set among racing workers, and hears its own key go."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client

from fleet.models.catalog import get_card
from fleet.placement import read_instances
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo, ShardAssignment
from fleet.wire.codec import encode
from fleet.worker.failover import Failover
from fleet.worker.liveness import Move


@pytest.fixture
def nc(provisioned_nc: Client) -> Client:
    return provisioned_nc


def node(node_id: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, memory_total_bytes=64 << 30,
        memory_available_bytes=32 << 30, cpu_count=2, models_available=["tiny-llm"],
        started_at=time.time(), at=time.time(),
    )


async def failover(nc: Client, self_id: str, trusted: bool = True, **hooks: object) -> Failover:
    js = nc.jetstream()
    return Failover(
        js, await js.key_value(subjects.NODES_BUCKET),
        await js.key_value(subjects.INSTANCES_BUCKET),
        {"tiny-llm": get_card("tiny-llm")}, self_id=self_id, trusted=lambda: trusted,
        **hooks,  # type: ignore[arg-type]
    )


async def setup(nc: Client, live: list[str], placed_on: dict[str, str]) -> None:
    js = nc.jetstream()
    nodes = await js.key_value(subjects.NODES_BUCKET)
    for node_id in live:
        await nodes.put(node_id, encode(node(node_id)))
    instances = await js.key_value(subjects.INSTANCES_BUCKET)
    for instance_id, on in placed_on.items():
        shard = ShardAssignment(node_id=on, runner_id="run-old", end_layer=2)
        await instances.create(instance_id, encode(Instance(
            instance_id=instance_id, model="tiny-llm", slots=2, created_at=0.0, shards=[shard],
        )))


async def placement(nc: Client) -> dict[str, str]:
    return {i.instance_id: i.shards[0].node_id for i in await read_instances(nc.jetstream())}


async def test_racing_sweeps_move_a_dead_nodes_instance_once_and_leave_live_ones(
    nc: Client,
) -> None:
    await setup(nc, ["me", "other"], {"i-dead": "ghost", "i-mine": "me", "i-other": "other"})
    sweeps = [await failover(nc, "me"), await failover(nc, "other")]
    results = await asyncio.gather(*(f.sweep() for f in sweeps))
    moves = [d for decisions in results for d in decisions if isinstance(d, Move)]
    assert {m.instance_id for m in moves} == {"i-dead"}  # both planned it, one CAS won
    moved = await placement(nc)
    assert moved["i-dead"] in ("me", "other")
    assert moved["i-mine"] == "me" and moved["i-other"] == "other"


async def test_without_evidence_nothing_moves_and_our_own_instance_never_does(
    nc: Client,
) -> None:
    # Our own key is missing (it expired while the KV was away): still ours, still here.
    await setup(nc, ["other"], {"i-dead": "ghost", "i-mine": "me"})
    assert await (await failover(nc, "me", trusted=False)).sweep() == []
    await (await failover(nc, "me")).sweep()
    assert (await placement(nc))["i-mine"] == "me"
    assert (await placement(nc))["i-dead"] in ("me", "other")


async def test_our_own_key_going_away_asks_for_a_heartbeat_and_moves_nothing(
    nc: Client,
) -> None:
    await setup(nc, ["me", "other"], {"i-mine": "me"})
    own_key_gone = asyncio.Event()
    watching = await failover(nc, "me", on_own_key_gone=own_key_gone.set)
    task = asyncio.create_task(watching.watch())
    try:
        await asyncio.wait_for(watching.loaded.wait(), 10)
        await (await nc.jetstream().key_value(subjects.NODES_BUCKET)).delete("me")
        await asyncio.wait_for(own_key_gone.wait(), 10)
        assert await watching.sweep() == []
        assert (await placement(nc))["i-mine"] == "me"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_move_deletes_the_dead_nodes_adverts_of_that_model(nc: Client) -> None:
    """Adverts are written never to expire by age: the sweep that moves a dead node's
    instance deletes the adverts of the runners its last heartbeat named, and no other."""
    js = nc.jetstream()
    await setup(nc, ["me", "doomed"], {"i-doomed": "doomed"})
    nodes = await js.key_value(subjects.NODES_BUCKET)
    await nodes.put("doomed", encode(node("doomed").model_copy(update={"runners": ["run-d"]})))
    prefixes = await js.key_value(subjects.PREFIXES_BUCKET)
    for key in ("tiny-llm.run-d", "tiny-llm.run-d.load", "tiny-llm.run-live"):
        await prefixes.put(key, b"{}")
    sweeper = await failover(nc, "me")
    await sweeper.refresh()  # it saw the node alive, with its runner
    await nodes.delete("doomed")
    moves = [d for d in await sweeper.sweep() if isinstance(d, Move)]
    assert [m.instance_id for m in moves] == ["i-doomed"]
    left = set(await prefixes.keys())
    assert left == {"tiny-llm.run-live"}
