"""A worker that dies between a NATS-published task's fair charge and its ack: the task's
tokens are counted once in its tenant's FLEET_FAIRNESS entry, whichever side of the charge it
died on (fleet.worker.fair_charge, fleet.worker.endings).

Real processes: worker "a" ends the task, then waits on a FIFO (the fault knob
FLEET_FAULT_CHARGE_GATE) before (or after) its charge and before its ack, and is SIGKILLed
there; worker "b" gets the redelivery, finds the terminal stored, charges it from that
terminal unless the mark says "a" did, and acks it. The fault engine is the model (a
plumbing double): what is under test is the worker's ending.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from fleet.bus.roles import FAIRNESS
from fleet.bus.task_log import TaskLog
from fleet.wire.events import TaskFinished
from fleet.wire.fairness import TenantShare
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    client,
    events_of,
    finished,
    submit,
    until_key,
    until_queue_empty,
)
from tests.integration.killing import fault_workers

pytestmark = pytest.mark.timeout(240)

ACK_WAIT = {"FLEET_ACK_WAIT_S": "4"}  # the dead worker's task is redelivered 4 s on


async def until_logged(log: Path, text: str, timeout: float = 60) -> None:
    """Until the worker's log holds `text` (a bounded poll: the worker, held at the gate,
    says nothing on NATS)."""
    async with asyncio.timeout(timeout):
        while text not in log.read_text(errors="replace"):
            await asyncio.sleep(0.05)


def unmarked(value: bytes) -> TenantShare | None:
    """The tenant's entry when it holds no task's mark: an ending that acked its task drops
    the mark it made or found."""
    share = TenantShare.model_validate_json(value)
    return None if share.settled else share


@pytest.mark.parametrize("point", ["before", "after"])
async def test_a_worker_killed_between_its_charge_and_its_ack_charges_the_task_once(
    nats_url: str, start_worker: WorkerFactory, tmp_path: Path, point: str
) -> None:
    gate = tmp_path / "charge-gate"
    os.mkfifo(gate)
    nc = await client(nats_url)
    kv = await nc.jetstream().key_value(FAIRNESS)
    gated = fault_workers(nc, start_worker, FLEET_FAULT_CHARGE_GATE=f"{point}:{gate}",
                          **ACK_WAIT)
    first, _ = await gated("a")
    task = TextGeneration(task_id=f"charged-{point}", model="fault-llm", max_tokens=100,
                          tenant="nats-a",
                          messages=[ChatMessage(role="user", content="tokens:5")])
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await until_logged(first.data_dir / "worker.log",
                       f"the ending of {task.task_id} waits {point} its charge")
    first.kill()  # its terminal is stored; its ack never sent
    result = finished(await collector)
    assert result.status == "completed" and result.usage is not None
    served = result.usage.prompt_tokens + result.usage.completion_tokens

    await fault_workers(nc, start_worker, **ACK_WAIT)("b")
    await until_queue_empty(nc.jetstream(), 60)  # b took the redelivery and acked it
    # The mark is dropped just after the ack (FairCharges.after_ack), so an empty queue can
    # be seen first: wait for the entry to lose it, then read what was charged.
    entry = await until_key(kv, "fault-llm.default.nats-a", unmarked, timeout=30)
    assert entry.counter == served  # once: not 0 (lost), not twice
    stored = [e for e in await TaskLog(nc).stored(task.task_id) if isinstance(e, TaskFinished)]
    assert len(stored) == 1  # one terminal: the redelivery only acked it
    await nc.close()

