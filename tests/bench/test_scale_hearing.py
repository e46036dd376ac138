"""Who hears what on a real server with 50 simulated nodes (bench.scale_sim, the node-agent
code of `fleet bench --only scale`): a worker of one model receives no advert of another, and
a gateway receives no event of another gateway's task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from bench.scale_sim import SimNode, sim_model, sim_node_id
from fleet.gateway.task_feed import StitchedEvents, TaskSubscriptions
from fleet.runner.fault_engine import fault_card
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskFinished, TokenChunk
from fleet.worker.node import node_info
from fleet.worker.prefix_adverts import ServedPrefixes, advert_key

NODES = 50
MODELS = 5
BUSY = 10  # nodes advertising four times a second and streaming tokens of their own tasks
WAIT_S = 30.0


@pytest.fixture
async def fleet_of_sims(provisioned_nc: Client, nats_url: str) -> AsyncIterator[list[SimNode]]:
    template = node_info("template", time.time(), [], [], None)
    cards = {sim_model(i, MODELS): fault_card(sim_model(i, MODELS)) for i in range(MODELS)}
    nodes = [SimNode(nats_url, i, MODELS, template, cards, "current") for i in range(NODES)]
    try:
        for batch in range(0, NODES, 10):
            await asyncio.gather(*(n.start() for n in nodes[batch:batch + 10]))
        for node in nodes[:BUSY]:
            node.busy = True
        yield nodes
    finally:
        await asyncio.gather(*(n.kill() for n in nodes))


class _Link:
    def __init__(self, nc: Client) -> None:
        self.nc = nc

    @property
    def connected(self) -> bool:
        return self.nc.is_connected


async def test_a_worker_of_model_a_hears_no_advert_of_model_b(
    fleet_of_sims: list[SimNode], nats_url: str
) -> None:
    worker = await nats.connect(nats_url)
    model = sim_model(0, MODELS)
    serving = {n.node_id for n in fleet_of_sims if n.model == model}
    heard: list[str] = []
    complete = asyncio.Event()

    def changed(values: dict[str, bytes], key: str | None) -> None:
        heard.extend(values if key is None else [key])
        if {k.split(".", 1)[1].removesuffix("-r0") for k in values} >= serving:
            complete.set()

    served = ServedPrefixes(lambda: {model}, changed)
    watch = asyncio.create_task(served.run(_Link(worker)))
    try:
        await asyncio.wait_for(complete.wait(), WAIT_S)  # every node of the model is heard
        # The other models advertise too, busy ones four times a second...
        other = await (await worker.jetstream().key_value(subjects.PREFIXES_BUCKET)).get(
            advert_key(sim_model(1, MODELS), f"{sim_node_id(1)}-r0"))
        assert other.value
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await worker.close()
    # ...and none of theirs reached this worker: its watch is filtered by the server.
    assert heard and all(key.startswith(f"{model}.") for key in heard)


async def test_a_gateway_receives_no_event_of_another_gateways_task(
    fleet_of_sims: list[SimNode], nats_url: str, provisioned_nc: Client
) -> None:
    gateways = [await nats.connect(nats_url) for _ in range(2)]
    hubs = [TaskSubscriptions(lambda nc=nc: nc) for nc in gateways]  # type: ignore[misc]
    tapped: list[list[bytes]] = [[], []]
    for hub, seen in zip(hubs, tapped, strict=True):
        hub.tap = seen.append
    readers = []
    for index, hub in enumerate(hubs):
        await hub.follow(f"own-{index}")
        readers.append(await StitchedEvents(
            gateways[index].jetstream(), f"own-{index}", asyncio.get_running_loop().time() + WAIT_S,
            hub=hub, replay=False).open())
    for nc in gateways:
        await nc.flush()  # the subscriptions are in place before the tasks' events
    before = [nc.stats["in_msgs"] for nc in gateways]
    js = provisioned_nc.jetstream()
    for index in range(2):
        for token in range(5):
            await js.publish(subjects.out(f"own-{index}"), encode(TokenChunk(
                task_id=f"own-{index}", index=token, token_id=token, text="t", at=time.time())))
        await js.publish(subjects.out(f"own-{index}"), encode(TaskFinished(
            task_id=f"own-{index}", status="completed", at=time.time())))
    try:
        for index, reader in enumerate(readers):
            items = [item async for item in reader]
            assert [i.event.task_id for i in items] == [f"own-{index}"] * 6
            assert isinstance(items[-1].event, TaskFinished)
    finally:
        for reader in readers:
            await reader.close()
        for hub in hubs:
            await hub.close()
    # While the busy nodes streamed their own tasks' tokens, each gateway was sent exactly
    # the six events of its own task: not one of the other gateway's, nor of the fleet's.
    for index, nc in enumerate(gateways):
        assert nc.stats["in_msgs"] - before[index] == 6
        assert len(tapped[index]) == 6
        await nc.close()
