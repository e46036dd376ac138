"""The janitor writes a terminal only for a message that owns its task id (a real nats-server,
the janitor on its own: no worker, no model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.wire import subjects
from fleet.wire.codec import decode_event, decode_model
from fleet.wire.events import ErrorReason, TaskFinished, TaskRefused
from fleet.worker.claims import Claims
from fleet.worker.janitor import Janitor
from tests.integration.harness import until_queue_empty

WAIT_S = 20.0


def raw_task(task_id: str, model: str) -> bytes:
    return orjson.dumps({
        "type": "text_generation", "task_id": task_id, "model": model, "prompt": "hi",
    })


@pytest.fixture
async def janitor(provisioned_nc: Client) -> AsyncIterator[Janitor]:
    keeper = Janitor(provisioned_nc, provisioned_nc.jetstream(), lambda m: m == "known")
    await keeper.start()
    triage = asyncio.create_task(keeper.triage_forever())  # the sweeper lease holder's duty
    yield keeper
    triage.cancel()
    await keeper.stop()


async def refusals(nc: Client) -> asyncio.Queue[TaskRefused]:
    found: asyncio.Queue[TaskRefused] = asyncio.Queue()

    async def on_refusal(msg: Msg) -> None:
        await found.put(decode_model(TaskRefused, msg.data))

    await nc.subscribe(subjects.REFUSED_ALL, cb=on_refusal)
    return found


async def terminal(nc: Client, task_id: str) -> TaskFinished | None:
    try:
        raw = await nc.jetstream().get_last_msg(subjects.OUT_STREAM, subjects.out(task_id))
    except Exception:
        return None
    event = decode_event(raw.data or b"")
    return event if isinstance(event, TaskFinished) else None


async def finished_soon(nc: Client, task_id: str) -> TaskFinished:
    """The task's terminal, from the live event itself or, when it was stored before the
    subscription, from the stream (a core subscriber can see the event before the stream has
    stored it, so the live one is not re-read from the stream)."""
    finished: asyncio.Future[TaskFinished] = asyncio.get_running_loop().create_future()

    async def on_event(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, TaskFinished) and not finished.done():
            finished.set_result(event)

    sub = await nc.subscribe(subjects.out(task_id), cb=on_event)
    try:
        if (found := await terminal(nc, task_id)) is not None:
            return found
        return await asyncio.wait_for(finished, WAIT_S)
    finally:
        await sub.unsubscribe()


async def test_an_unknown_model_ends_a_fresh_id_and_refuses_a_claimed_one(
    provisioned_nc: Client, janitor: Janitor
) -> None:
    nc = provisioned_nc
    js = nc.jetstream()
    refused = await refusals(nc)
    claims = await Claims.open(nc, js)
    assert await claims.admit("victim", "1") is None  # the victim's message owns its id

    await js.publish("fleet.tasks.nope", raw_task("victim", "nope"))
    refusal = await asyncio.wait_for(refused.get(), WAIT_S)
    assert (refusal.task_id, refusal.reason) == ("victim", "task_id_taken")
    assert await terminal(nc, "victim") is None

    await js.publish("fleet.tasks.nope", raw_task("fresh", "nope"))
    result = await finished_soon(nc, "fresh")
    assert result.reason is ErrorReason.MODEL_NOT_FOUND


async def test_max_deliveries_ends_only_the_message_that_owns_the_id(
    provisioned_nc: Client, janitor: Janitor
) -> None:
    nc = provisioned_nc
    js = nc.jetstream()
    claims = await Claims.open(nc, js)
    owner = await js.publish("fleet.tasks.known", raw_task("owned", "known"))
    other = await js.publish("fleet.tasks.known", raw_task("victim", "known"))
    assert await claims.admit("owned", str(owner.seq)) is None
    assert await claims.admit("victim", "some-other-message") is None

    advisory = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.FLEET_TASKS.tasks-known"
    for seq in (other.seq, owner.seq):
        await js.publish(advisory, orjson.dumps({"stream_seq": seq, "deliveries": 3}))

    result = await finished_soon(nc, "owned")
    assert result.reason is ErrorReason.MAX_DELIVERIES
    # Both advisories were handled in order: the non-owner's first, and it wrote nothing.
    assert await terminal(nc, "victim") is None
    await until_queue_empty(js)  # the owner's message goes after its terminal is stored
