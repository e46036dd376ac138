"""A gateway's per-task subscriptions (fleet/gateway/task_feed.py) on a real server: a resumed
reader gets the stored events then the live ones, none twice; and a connection lost while the
task goes on (its events stored, not delivered) is read back after the reconnect."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.aio.client import Client

from fleet.gateway.task_feed import StitchedEvents, TaskSubscriptions
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskFinished, TokenChunk

WAIT_S = 20.0


def token(task_id: str, index: int) -> bytes:
    return encode(TokenChunk(task_id=task_id, index=index, token_id=index, text="t",
                             at=time.time()))


async def read_all(reader: StitchedEvents) -> list[int]:
    """Token indexes in the order read, until the terminal."""
    seen: list[int] = []
    async for item in reader:
        if isinstance(item.event, TokenChunk):
            seen.append(item.event.index)
    return seen


async def test_a_resumed_reader_gets_stored_then_live_events_once(
    provisioned_nc: Client, nats_url: str
) -> None:
    js = provisioned_nc.jetstream()
    for index in range(3):  # stored before anyone listens
        await js.publish(subjects.out("resumed"), token("resumed", index))
    gateway = await nats.connect(nats_url)
    hub = TaskSubscriptions(lambda: gateway)
    await hub.follow("resumed")
    reader = await StitchedEvents(gateway.jetstream(), "resumed",
                                  asyncio.get_running_loop().time() + WAIT_S, hub=hub).open()
    for index in range(3, 6):
        await js.publish(subjects.out("resumed"), token("resumed", index))
    await js.publish(subjects.out("resumed"), encode(
        TaskFinished(task_id="resumed", status="completed", at=time.time())))
    try:
        assert await read_all(reader) == [0, 1, 2, 3, 4, 5]
    finally:
        await reader.close()
        await hub.close()
        await gateway.close()
    assert hub.following == 0  # the subscription went with its last reader


async def test_events_stored_while_the_gateway_was_disconnected_are_read_back(
    provisioned_nc: Client, nats_url: str
) -> None:
    js = provisioned_nc.jetstream()
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    gateway = await nats.connect(nats_url, reconnected_cb=on_reconnect, reconnect_time_wait=1)
    hub = TaskSubscriptions(lambda: gateway)
    refills = asyncio.create_task(hub.watch_reconnects())
    await hub.follow("gap")
    reader = await StitchedEvents(gateway.jetstream(), "gap",
                                  asyncio.get_running_loop().time() + WAIT_S, hub=hub,
                                  replay=False).open()
    await gateway.flush()
    try:
        await js.publish(subjects.out("gap"), token("gap", 0))
        gateway._transport.close()  # the gateway's link drops; the server and the task go on
        for index in range(1, 4):  # stored while the gateway cannot hear them
            await js.publish(subjects.out("gap"), token("gap", index))
        await asyncio.wait_for(reconnected.wait(), WAIT_S)
        await js.publish(subjects.out("gap"), encode(
            TaskFinished(task_id="gap", status="completed", at=time.time())))
        assert await read_all(reader) == [0, 1, 2, 3]
    finally:
        refills.cancel()
        await reader.close()
        await hub.close()
        await gateway.close()
