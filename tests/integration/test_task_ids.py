"""Task ids cannot be hijacked: each attack of issue 11, made with raw nats-py by anyone who may
publish tasks, now fails to do harm.

The worker runs the fault-injection engine (a plumbing double): what is under test is who may
write on `fleet.out.<task_id>`, not a model. The attacker sets `Fleet-Reply-To` to its own
inbox and must hear a TaskRefused there; the victim's stored events must be exactly its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.wire import subjects
from fleet.wire.codec import decode_event, decode_events, decode_model
from fleet.wire.events import ErrorReason, OutputEvent, TaskAccepted, TaskRefused, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    add_fault_card,
    events_of,
    finished,
    run_task,
    serving,
    submit,
    until_queue_empty,
)


def fault_task(task_id: str, knobs: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=100,
        messages=[ChatMessage(role="user", content=knobs)],
    )


def raw_task(task_id: object, model: str = "fault-llm") -> bytes:
    """What an attacker writes by hand: no Fleet code, no Nats-Msg-Id."""
    return orjson.dumps({
        "type": "text_generation", "task_id": task_id, "model": model,
        "messages": [{"role": "user", "content": "tokens:2"}],
    })


class Attacker:
    """A raw nats-py publisher of tasks that listens for refusals on its own inbox."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.inbox = nc.new_inbox()
        self.refusals: asyncio.Queue[TaskRefused] = asyncio.Queue()

    async def start(self) -> Attacker:
        await self.nc.subscribe(self.inbox, cb=self._on_refusal)
        return self

    async def _on_refusal(self, msg: Msg) -> None:
        await self.refusals.put(decode_model(TaskRefused, msg.data))

    async def publish(self, subject: str, body: bytes) -> None:
        await self.nc.jetstream().publish(
            subject, body, headers={subjects.REPLY_HEADER: self.inbox}
        )

    async def refused(self, timeout: float = 30.0) -> TaskRefused:
        return await asyncio.wait_for(self.refusals.get(), timeout)


async def stored_events(nc: Client, task_id: str) -> list[OutputEvent]:
    """Everything FLEET_OUT holds for a task, read once to the end (no waiting for more)."""
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        subjects.out(task_id), stream=subjects.OUT_STREAM, config=None,
    )
    found: list[OutputEvent] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=1.0)
            except TimeoutError:
                return found
            for msg in msgs:
                found.extend(decode_events(msg.data))  # a terminal may carry the last tokens
                await msg.ack()
    finally:
        await sub.unsubscribe()


async def out_count(nc: Client) -> int:
    return (await nc.jetstream().stream_info(subjects.OUT_STREAM)).state.messages


async def _serving(nats_url: str, start_worker: WorkerFactory) -> Client:
    worker = start_worker("a")
    nc, _ = await serving(nats_url, worker, add_fault_card(worker.data_dir))
    return nc


async def _first_accepted(nc: Client, task_id: str) -> asyncio.Event:
    seen = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        if isinstance(decode_event(msg.data), TaskAccepted):
            seen.set()

    await nc.subscribe(subjects.out(task_id), cb=on_event)
    return seen


async def test_a_task_on_an_unknown_model_cannot_end_another_task(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await _serving(nats_url, start_worker)
    attacker = await Attacker(nc).start()
    victim = fault_task("victim-1", "tokens:3 delay_ms:700")
    accepted = await _first_accepted(nc, victim.task_id)
    collector = asyncio.create_task(events_of(nc, victim.task_id, timeout=60))
    await submit(nc, victim)
    await asyncio.wait_for(accepted.wait(), 30)

    await attacker.publish("fleet.tasks.no-such-model", raw_task("victim-1", "no-such-model"))
    refusal = await attacker.refused()
    assert refusal.reason == "task_id_taken" and refusal.task_id == "victim-1"
    assert refusal.model == "no-such-model"

    events = await collector
    result = finished(events)
    assert result.status == "completed"  # its own terminal, stored, not dropped as a duplicate
    assert [e.index for e in events if isinstance(e, TokenChunk)] == [0, 1, 2]
    stored = await stored_events(nc, victim.task_id)
    assert finished(stored) == result
    assert all(getattr(e, "reason", None) is not ErrorReason.MODEL_NOT_FOUND for e in stored)
    await nc.close()


async def test_a_finished_task_id_cannot_be_reused(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await _serving(nats_url, start_worker)
    attacker = await Attacker(nc).start()
    first = finished(await run_task(nc, fault_task("done-1", "tokens:2"), timeout=60))
    assert first.status == "completed"
    before = await stored_events(nc, "done-1")

    records: asyncio.Queue[Msg] = asyncio.Queue()
    await nc.subscribe(subjects.REFUSED_ALL, cb=records.put)
    await attacker.publish(subjects.tasks("fault-llm"), raw_task("done-1"))
    refusal = await attacker.refused()
    assert refusal.reason == "task_id_taken" and refusal.task_id == "done-1"
    # A reply header naming the victim's own subject is not answered there.
    await nc.jetstream().publish(
        subjects.tasks("fault-llm"), raw_task("done-1"),
        headers={subjects.REPLY_HEADER: subjects.out("done-1")},
    )
    for _ in range(2):  # both refusals recorded: both messages were seen and refused
        await asyncio.wait_for(records.get(), 30)

    after = await stored_events(nc, "done-1")
    assert after == before  # no second task_accepted, no tokens after the terminal
    assert sum(isinstance(e, TaskAccepted) for e in after) == 1
    # The refused message is termed, not left to be redelivered (needs the loop to send
    # the verb Settled carries).
    await until_queue_empty(nc.jetstream())
    await nc.close()


async def test_a_duplicate_of_a_running_task_is_refused(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await _serving(nats_url, start_worker)
    attacker = await Attacker(nc).start()
    victim = fault_task("live-1", "tokens:4 delay_ms:500")
    accepted = await _first_accepted(nc, victim.task_id)
    collector = asyncio.create_task(events_of(nc, victim.task_id, timeout=60))
    await submit(nc, victim)
    await asyncio.wait_for(accepted.wait(), 30)

    await attacker.publish(subjects.tasks("fault-llm"), raw_task("live-1"))
    assert (await attacker.refused()).reason == "task_id_taken"

    events = await collector
    assert finished(events).status == "completed"
    assert sum(isinstance(e, TaskAccepted) for e in events) == 1
    assert [e.index for e in events if isinstance(e, TokenChunk)] == [0, 1, 2, 3]
    await nc.close()


BAD_IDS: list[Any] = ["x" * 200, "x" * 129, "a.b", "a*", "a>", "*", ">", "a b", " ", "", 42]


@pytest.mark.parametrize("model", ["fault-llm", "no-such-model"])
async def test_an_id_that_is_not_a_subject_token_is_refused_and_writes_nowhere(
    nats_url: str, start_worker: WorkerFactory, model: str
) -> None:
    nc = await _serving(nats_url, start_worker)
    attacker = await Attacker(nc).start()
    # The ids a cut or cleaned bad id could land on, finished before the attack.
    for near in ("x" * 128, "a", "ab"):
        assert finished(await run_task(nc, fault_task(near, "tokens:1"), timeout=60))
    stored = await out_count(nc)

    for bad in BAD_IDS:
        await attacker.publish(subjects.tasks(model), raw_task(bad, model))
    refusals = [await attacker.refused() for _ in BAD_IDS]
    assert sorted(map(repr, (r.task_id for r in refusals))) == sorted(
        repr(bad if isinstance(bad, str) else None) for bad in BAD_IDS
    )
    assert {r.reason for r in refusals} == {"invalid_task_id"}
    assert await out_count(nc) == stored  # not one event written, on any id
    await nc.close()
