"""Demand placement against a real nats-server: who places, what, and when nothing can."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client

from fleet.models.catalog import get_card
from fleet.placement import read_instances
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo
from fleet.worker.demand import Demand


@pytest.fixture
def nc(provisioned_nc: Client) -> Client:
    return provisioned_nc


def node(node_id: str, free_gib: int, *available: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, memory_total_bytes=64 << 30,
        memory_available_bytes=free_gib << 30, cpu_count=2, models_available=list(available),
        started_at=time.time(), at=time.time(),
    )


async def demand(nc: Client, nodes: list[NodeInfo], placed: tuple[Instance, ...] = ()) -> Demand:
    js = nc.jetstream()
    cards = {card.id: card for card in (get_card("tiny-llm"), get_card("flux1-dev"))}
    return Demand(
        js, await js.key_value(subjects.INSTANCES_BUCKET), cards,
        placed=lambda: placed, live_nodes=lambda: nodes, slots=3,
    )


async def test_racing_workers_place_one_instance_on_a_node_that_can_provide_it(
    nc: Client,
) -> None:
    nodes = [node("big-but-empty", 32), node("small", 4, "tiny-llm"), node("mid", 8, "tiny-llm")]
    workers = [await demand(nc, nodes) for _ in range(4)]
    placed = await asyncio.gather(*(worker.want("tiny-llm") for worker in workers))
    [winner] = [instance for instance in placed if instance is not None]
    assert await read_instances(nc.jetstream()) == [winner]
    assert winner.model == "tiny-llm" and winner.slots == 3
    assert [shard.node_id for shard in winner.shards] == ["mid"]


async def test_nothing_is_placed_for_a_served_model_an_unknown_one_or_one_nobody_has(
    nc: Client,
) -> None:
    nodes = [node("n1", 32, "tiny-llm")]
    served = (await demand(nc, nodes)).want  # placed once here, so served from now on
    first = await served("tiny-llm")
    assert first is not None
    follower = await demand(nc, nodes, placed=(first,))
    assert await follower.want("tiny-llm") is None
    assert await follower.want("no-such-model") is None
    assert await follower.want("flux1-dev") is None  # a card, but no node has its weights
    assert [i.instance_id for i in await read_instances(nc.jetstream())] == ["tiny-llm-auto"]


async def test_the_sweep_finds_models_with_queued_tasks(nc: Client) -> None:
    js = nc.jetstream()
    await js.publish(subjects.tasks("tiny-llm"), b"{}")
    await js.publish(subjects.tasks("flux1-dev"), b"{}")
    assert await (await demand(nc, [])).queued_models() == ["flux1-dev", "tiny-llm"]


async def test_a_model_no_node_can_hold_is_split_over_the_fewest_nodes(nc: Client) -> None:
    def ringed(node_id: str, free_mb: int) -> NodeInfo:
        info = node(node_id, 0, "smollm2-135m")
        return info.model_copy(update={
            "memory_available_bytes": free_mb * 1_000_000, "ring_address": f"h:{free_mb}",
        })

    # No node holds 538 MB; each rank holds the 113 MB embedding and 14.2 MB a layer.
    nodes = [ringed("a", 350), ringed("b", 400), ringed("c", 100)]
    js = nc.jetstream()
    cards = {"smollm2-135m": get_card("smollm2-135m")}
    worker = Demand(
        js, await js.key_value(subjects.INSTANCES_BUCKET), cards,
        placed=lambda: (), live_nodes=lambda: nodes, slots=2,
    )
    placed = await worker.want("smollm2-135m")
    assert placed is not None and placed.instance_id == "smollm2-135m-auto"
    assert [(s.node_id, s.rank, s.start_layer, s.end_layer, s.ring_address)
            for s in placed.shards] == [("b", 0, 0, 16, "h:400"), ("a", 1, 16, 30, "h:350")]
    assert await read_instances(js) == [placed]
