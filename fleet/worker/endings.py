"""How a task message leaves this node: its terminal event stored, then its message settled
with the verb the ack policy gives; or handed back, or settled as the intake decided.

Each ending runs as a child of the worker's Supervisor, beside the loop: storing a terminal
may wait out a broker election (the retry budget), and no other task's tokens should wait
for that. The loop has already freed the task's slot (TaskEnded) when it starts one. A
terminal that cannot be stored within the budget is not acked: the message is redelivered
after AckWait and its redelivery ends it; the worker keeps serving.

The message stays held (fleet.worker.acks) until its verb is sent, not only until its task
left the runner: storing a terminal through a broker restart or an election can outlast
AckWait, and a message no longer beaten for was redelivered then, to a node that took the task
over (from this one, when the redelivery came back here) while its end was being stored. Held,
it keeps its in_progress beats, and a redelivery of it is recognised as the same message
(`redelivered_while_held`, answered with its newest delivery). An ending that raises lets it
go without a verb, as before: AckWait redelivers it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any

from nats.aio.msg import Msg

from fleet.aio import Supervisor
from fleet.wire.events import ErrorReason, TaskFinished
from fleet.worker.acks import AckPolicy, Stage
from fleet.worker.fair_charge import FairCharges
from fleet.worker.outputs import TaskOutput
from fleet.worker.spans import TaskSpans
from fleet.worker.takeover import TaskFenced

log = logging.getLogger(__name__)

# Fault injection, for tests only (like FLEET_FAULT_UPLOAD_GATE): `before:<fifo>` or
# `after:<fifo>`; an ending of a task to charge reads one line from the FIFO before (after)
# its fair charge and before its ack, so a test can SIGKILL the worker exactly there
# (tests/integration/test_fair_charge_death.py).
CHARGE_GATE_ENV = "FLEET_FAULT_CHARGE_GATE"


async def _gate(gate: str, point: str, task_id: str) -> None:
    """`gate`: CHARGE_GATE_ENV's value, read once by Endings (not twice an ending)."""
    where, _, fifo = gate.partition(":")
    if where != point or not fifo:
        return
    log.warning("fault injection: the ending of %s waits %s its charge on %s", task_id,
                point, fifo)

    def read() -> None:
        with open(fifo, "rb") as gate:
            gate.readline()

    await asyncio.to_thread(read)

class Endings:
    def __init__(
        self, output: TaskOutput, acks: AckPolicy, spans: TaskSpans, owner: Supervisor,
        node_id: str, charges: FairCharges | None = None,
    ) -> None:
        self.output = output
        self.charges = charges  # a NATS-published task's tokens, to its tenant's fair share
        self.acks = acks
        self.spans = spans
        self.owner = owner
        self.node_id = node_id
        self._running: set[asyncio.Task[Any]] = set()
        self.unstored = 0  # terminals that could not be stored (their tasks are redelivered)
        self.fenced = 0  # tasks given up at their ending: another attempt had taken them over
        self._charge_gate = os.environ.get(CHARGE_GATE_ENV, "")  # tests only

    def finish(self, event: TaskFinished, msg: Msg | None) -> None:
        """Store a runner's terminal (its earlier events were queued before it), then ack."""
        self._start(f"finish {event.task_id}", self._finish(event, msg))

    def fail(self, task_id: str, reason: ErrorReason, message: str, msg: Msg | None) -> None:
        """End a task that never reached a runner (deadline, cancel, missing inputs)."""
        self._start(f"fail {task_id}", self._fail(task_id, reason, message, msg))

    def settle(self, task_id: str | None, msg: Msg, stage: Stage,
               finished: TaskFinished | None = None) -> None:
        """Send `msg` the verb of `stage` (intake outcomes, hand-backs): no event to store,
        and the caller has ended the message's span. `finished`: the terminal an earlier
        attempt stored (a redelivery of a finished task), charged before the ack in case
        that attempt died before its own charge (a no-op when it had made it)."""
        if finished is not None and self.charges is not None:
            self._start(f"{stage} {task_id}", self._charge_and_settle(finished, msg, stage))
            return
        self._start(f"{stage} {task_id}", self.acks.settle(task_id, msg, stage))

    async def wait(self, timeout: float) -> None:
        """Let endings in progress finish (at shutdown): a terminal stored now is a task that
        another worker does not have to redo."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout)

    def _start(self, name: str, coro: Coroutine[Any, Any, Any]) -> None:
        self.owner.spawn(name, coro, into=self._running)

    async def _finish(self, event: TaskFinished, msg: Msg | None) -> None:
        try:
            await self._store_and_ack(event, msg)
        except BaseException:
            self.acks.release(event.task_id)  # no verb: AckWait redelivers it
            raise

    async def _store_and_ack(self, event: TaskFinished, msg: Msg | None) -> None:
        try:
            stored = await self.output.finish(event)
        except TaskFenced as exc:
            self._given_up(event.task_id, exc)
            return
        except Exception as exc:
            self._not_stored(event.task_id, exc)
            await self._settle(event.task_id, msg, Stage.FINISHED_NOT_STORED, "none")
            return
        ended = stored if isinstance(stored, TaskFinished) else event
        self.spans.finished(ended)
        # Charged between the stored terminal and the ack: a death before the ack leaves the
        # message to a redelivery, which charges from the stored terminal (once: the mark).
        charge = None
        if self.charges is not None:
            await _gate(self._charge_gate, "before", event.task_id)
            charge = await self.charges.before_ack(msg, ended)
            await _gate(self._charge_gate, "after", event.task_id)
        acked = await self._settle(event.task_id, msg, Stage.FINISHED_STORED, "ack")
        if self.charges is not None and acked:
            await self.charges.after_ack(charge)

    async def _charge_and_settle(self, finished: TaskFinished, msg: Msg, stage: Stage) -> None:
        assert self.charges is not None
        charge = await self.charges.before_ack(msg, finished)
        if await self.acks.settle(finished.task_id, msg, stage):
            await self.charges.after_ack(charge)

    async def _fail(
        self, task_id: str, reason: ErrorReason, message: str, msg: Msg | None
    ) -> None:
        try:
            await self._store_failure(task_id, reason, message, msg)
        except BaseException:
            self.acks.release(task_id)  # no verb: AckWait redelivers it
            raise

    async def _store_failure(
        self, task_id: str, reason: ErrorReason, message: str, msg: Msg | None
    ) -> None:
        try:
            stored = await self.output.fail(task_id, reason, message, node_id=self.node_id)
        except TaskFenced as exc:
            self._given_up(task_id, exc)
            return
        except Exception as exc:
            self._not_stored(task_id, exc)
            await self._settle(task_id, msg, Stage.FINISHED_NOT_STORED, "none")
            return
        self.spans.finished(stored)
        await self._settle(task_id, msg, Stage.FINISHED_STORED, "ack")

    async def _settle(self, task_id: str | None, msg: Msg | None, stage: Stage, verb: str) -> bool:
        """Whether the verb was sent (True with no message to send it to)."""
        sent = True
        if msg is not None:
            sent = await self.acks.settle(task_id, msg, stage)
            verb = verb if sent else f"{verb} failed"
        self.spans.settled(task_id, verb)
        return sent

    def _given_up(self, task_id: str, exc: TaskFenced) -> None:
        """Another attempt took the task over: its terminal is that attempt's to write, and
        its message that attempt's to settle (fleet.worker.takeover)."""
        self.acks.release(task_id)  # no more beats: the message is the other attempt's
        self.fenced += 1
        log.warning("%s; given up without a terminal or a verb", exc)
        self.spans.settled(task_id, "fenced")

    def _not_stored(self, task_id: str, exc: BaseException) -> None:
        self.unstored += 1
        log.error(
            "task %s: terminal not stored (%s: %s); not acked, it will be redelivered",
            task_id, type(exc).__name__, exc,
        )
