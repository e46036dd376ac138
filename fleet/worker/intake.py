"""What happens to a task message the moment it is fetched: decode, and the checks that can
end it before it ever reaches a runner (bad bytes, redelivery, early cancel, deadline)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task
from fleet.wire.events import ErrorReason, ImageChunk, TaskFinished, TokenChunk, ToolCallChunk
from fleet.wire.tasks import is_past
from fleet.worker.cluster import ClusterLink
from fleet.worker.outputs import TaskOutput
from fleet.worker.state import PendingTask

log = logging.getLogger(__name__)

STREAMED = (TokenChunk, ToolCallChunk, ImageChunk)


@dataclass(frozen=True)
class Queued:
    pending: PendingTask


@dataclass(frozen=True)
class Settled:
    """The message was answered and acked or terminated here."""

    task_id: str | None
    reason: str
    verb: str = "ack"  # the JetStream verb that settled it: ack, or term for poison


class Intake:
    def __init__(self, js: JetStreamContext, output: TaskOutput, cluster: ClusterLink) -> None:
        self.js = js
        self.output = output
        self.cluster = cluster
        self.invalid_count = 0

    async def receive(self, msg: Msg) -> Queued | Settled:
        delivery = msg.metadata.num_delivered if msg.metadata else 1
        try:
            task = decode_task(msg.data)
        except DecodeError as exc:
            return await self._invalid(msg, exc.task_id, str(exc))
        model = subjects.model_of_task_subject(msg.subject)
        if task.model != model:
            return await self._invalid(
                msg, task.task_id, f"task names model {task.model!r} but was sent to {msg.subject}"
            )
        if delivery > 1 and (settled := await self._redelivered(msg, task.task_id)):
            return settled
        if await self.cluster.is_cancelled(task.task_id):
            return await self._end(msg, task.task_id, ErrorReason.CANCELLED, "cancelled early")
        if is_past(task.deadline, datetime.now(UTC)):
            return await self._end(
                msg, task.task_id, ErrorReason.DEADLINE, "the deadline passed before it started"
            )
        hashes = task.image_hashes()
        card = self.cluster.cards.get(model)
        if hashes and card is not None and not card.is_image and "vision" not in card.capabilities:
            return await self._end(
                msg, task.task_id, ErrorReason.UNSUPPORTED,
                f"model {model!r} reads text only; the task carries images",
            )
        return Queued(PendingTask(
            task=task, received_at=time.time(), delivery=delivery,
            inputs=None if hashes else {},
        ))

    async def _invalid(self, msg: Msg, task_id: str | None, message: str) -> Settled:
        self.invalid_count += 1
        log.warning("invalid task on %s (%s): %s", msg.subject, task_id or "no id", message)
        if task_id:
            await self.output.fail(task_id, ErrorReason.INVALID_TASK, message)
        with contextlib.suppress(Exception):
            await msg.term()  # poison: never redeliver
        return Settled(task_id, "invalid_task", "term")

    async def _end(self, msg: Msg, task_id: str, reason: ErrorReason, message: str) -> Settled:
        await self.output.fail(task_id, reason, message, node_id=self.cluster.node_id)
        with contextlib.suppress(Exception):
            await msg.ack()
        return Settled(task_id, reason.value)

    async def _redelivered(self, msg: Msg, task_id: str) -> Settled | None:
        """A worker took this task before and died. Rerun it only if no output was streamed:
        a client must never see tokens twice."""
        last = await self.output.last_event(task_id)
        if isinstance(last, TaskFinished):
            with contextlib.suppress(Exception):
                await msg.ack()
            return Settled(task_id, "already_finished")
        if isinstance(last, STREAMED):
            return await self._end(
                msg, task_id, ErrorReason.WORKER_LOST,
                "the worker running this task was lost after output had started",
            )
        return None
