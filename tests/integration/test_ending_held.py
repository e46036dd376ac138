"""A task whose end is being stored keeps its message held (fleet.worker.endings): the worker
beats for it until its verb, so a store that outlasts AckWait (a broker restart, an election)
does not see the message redelivered and taken over, by this very node among others.

Real processes: worker "a" ends a task, then waits on a FIFO (the fault knob
FLEET_FAULT_CHARGE_GATE) between its stored terminal and its ack for twice AckWait, watched
on the in_progress beats it sends for the message; then the gate opens and it acks. The fault
engine is the model (a plumbing double): what is under test is the worker's ending.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from fleet.wire import subjects
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import client, events_of, finished, submit, until_queue_empty
from tests.integration.killing import fault_workers
from tests.integration.test_fair_charge_death import until_logged

pytestmark = pytest.mark.timeout(240)

ACK_WAIT_S = 2.0
IN_PROGRESS = b"+WPI"  # JetStream's in_progress verb on a message's ack subject


async def test_a_message_is_beaten_while_its_end_is_stored_and_acked_once(
    nats_url: str, start_worker: WorkerFactory, tmp_path: Path,
) -> None:
    gate = tmp_path / "charge-gate"
    os.mkfifo(gate)
    nc = await client(nats_url)
    worker, _ = await fault_workers(nc, start_worker, FLEET_FAULT_CHARGE_GATE=f"before:{gate}",
                                    FLEET_ACK_WAIT_S=str(ACK_WAIT_S))("a")
    task = TextGeneration(task_id="ending-held", model="fault-llm", max_tokens=100,
                          tenant="nats-a",  # a charged task: its ending passes the gate
                          messages=[ChatMessage(role="user", content="tokens:5")])
    held_from: float | None = None
    held_long = asyncio.Event()

    async def on_verb(msg: Msg) -> None:
        # A beat more than twice AckWait after the ending reached the gate: without beats
        # JetStream would have redelivered the message after one AckWait.
        if (msg.data == IN_PROGRESS and held_from is not None
                and time.monotonic() - held_from > 2 * ACK_WAIT_S):
            held_long.set()

    verbs = await nc.subscribe("$JS.ACK.>", cb=on_verb)
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await until_logged(worker.data_dir / "worker.log",
                       f"the ending of {task.task_id} waits before its charge")
    held_from = time.monotonic()
    await asyncio.wait_for(held_long.wait(), 30)
    await asyncio.to_thread(gate.write_bytes, b"go\n")  # the ending goes on: charge, ack
    result = finished(await collector)
    assert result.status == "completed"
    js = nc.jetstream()
    await until_queue_empty(js, 30)
    info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable("fault-llm"))
    assert info.num_redelivered == 0, "the message was delivered again while its end was held"
    assert "redelivered" not in worker.log()
    await verbs.unsubscribe()
    await nc.close()
