"""Publishing a task's events on `fleet.out.<task_id>`: stored whole and in order, or the
task does not end `completed`.

Every event goes through JetStream with the server's confirmation (fleet.bus.confirmed): a
window of pending acks per task keeps a token event (one or several tokens, as the runner
coalesced them) at one publish (~the cost of the core publish
it replaces), and a broker restart or an election only delays the events, which wait in order
and go out when the connection is back. Each event has a Nats-Msg-Id
`<task_id>-<kind>-<index>`, so a re-send is stored once.

`finish` first settles the task's earlier events. If they cannot be stored whole within the
broker budget (whole but out of order is whole: readers read in index order,
fleet.bus.task_events), a `completed` terminal becomes `failed` with reason
`output_lost` (a failed or cancelled terminal keeps its own reason). If the terminal itself
cannot be stored, `finish` raises BrokerUnavailable: the worker must not ack the task then,
and its redelivery ends it (`worker_lost`, output had started) on a later try.

A terminal may carry the task's last token events (`TaskFinished.last_tokens`: those its
runner wrote in the same read as the terminal, fleet.worker.tails): they are stored with it,
in one message, so the stream holds both or neither, and readers expand them back into the
events they stand for. An output_lost terminal carries none (the output is not whole).

Every event is fenced (fleet.worker.takeover): it carries the fence of this node's attempt
(0 until a takeover here wrote one, `take_over`), and once another attempt has taken the task
over the stream refuses it; `finish` and `fail` then raise TaskFenced (no terminal, no ack),
and `on_fenced` hears of the first refused event.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from fleet.bus.confirmed import ConfirmedPublisher
from fleet.bus.connect import MSG_ID, js_publish
from fleet.bus.hpub import header_block, header_lines
from fleet.bus.retry import BROKER_BUDGET_S
from fleet.bus.task_log import TaskLog
from fleet.errors import BrokerUnavailable
from fleet.telemetry import inject_headers, send_span
from fleet.wire import subjects
from fleet.wire.codec import encode, encode_accepted
from fleet.wire.events import (
    EmbeddingChunk,
    ErrorChunk,
    ErrorReason,
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TaskFence,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    failed,
)
from fleet.wire.token_frames import TokenFrame
from fleet.worker.takeover import TaskFenced, fence_headers, is_fenced, take_fence

log = logging.getLogger(__name__)

ERROR_CHUNK_BUDGET_S = 5.0  # the words before an output_lost terminal are a courtesy
_MSG_ID_LINE = MSG_ID.encode() + b": %s\r\n"


@dataclass(slots=True)
class _Lines:
    """A task's header lines made once (fleet.bus.hpub): its fence's, and its trace context's
    for the last context its events went out in."""

    fence: bytes
    context: Context | None = None
    trace: bytes = b""


def event_msg_id(event: OutputEvent | TokenFrame, fence: int = 0) -> str:
    """`<task_id>-<kind>-<index>`: the same event published twice is stored once. An attempt
    that took the task over (`fence` > 0, its fence's sequence) adds `@<fence>`: it re-makes
    indexes an earlier attempt may have stored beyond a hole, batched otherwise (one event of 16
    tokens where the earlier had one of 1 at the same first index), and such an event deduped
    against the earlier copy would leave the indexes only it carried missing (issue 24's gap
    at a seam). The earlier attempt's copies are superseded (fleet.bus.task_log); its late
    events are refused by the fence, so nothing needs deduplicating across attempts."""
    suffix = f"@{fence}" if fence else ""
    match event:
        case TokenFrame() | TokenChunk() | ToolCallChunk() | EmbeddingChunk():
            index = str(event.index)
        case ImageChunk():
            partial = "final" if event.partial_index is None else event.partial_index
            index = f"{event.image_index}.{partial}"
        case TaskAccepted():
            index = str(event.delivery)  # a redelivery is accepted anew
            if event.attempt:  # and so is each continuation, on the same delivery too
                index += f".{event.attempt}"
        case ErrorChunk():
            index = event.reason.value
        case TaskFinished():
            return finished_msg_id(event.task_id)
    return f"{event.task_id}-{event.type}-{index}{suffix}"


def finished_msg_id(task_id: str) -> str:
    """One terminal per task: a racing second publisher (janitor, intake) is a no-op."""
    return f"finished-{task_id}"


class TaskOutput:
    def __init__(
        self, nc: Client, js: JetStreamContext, *, budget_s: float = BROKER_BUDGET_S,
        on_fenced: Callable[[str], None] | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.budget_s = budget_s
        self.confirmed = ConfirmedPublisher(nc, budget_s=budget_s, on_fenced=on_fenced)
        self.log = TaskLog(nc, js, budget_s=budget_s)  # the reading side of FLEET_OUT
        self.fences: dict[str, int] = {}  # task id -> this node's fence (absent: 0)
        # task id -> its fence headers encoded (made once), and the trace context of its last
        # event with that context's headers encoded (made once a span)
        self._fenced: dict[str, _Lines] = {}
        self.taken_from: dict[str, TaskFence | None] = {}  # task id -> the fence replaced

    async def take_over(
        self, task_id: str, node_id: str, delivery: int, *, handed_in: bool = False
    ) -> int:
        """Fence the task for this node's attempt (before reading back what was stored):
        from now on the stream refuses every event of an earlier attempt."""
        fence, replaced = await take_fence(self.js, task_id, node_id, delivery,
                                           handed_in=handed_in)
        self.fences[task_id] = fence
        self._fenced.pop(task_id, None)
        self.taken_from[task_id] = replaced
        return fence

    def _headers(self, task_id: str, msg_id: str) -> bytes:
        """The header block `headers_for` would make of the fence's headers, encoded
        (fleet.bus.hpub): the task's fence headers once a task, the trace context's once a
        span, not once an event (three or more events a task: issue 23)."""
        lines = self._fenced.get(task_id)
        if lines is None:
            lines = self._fenced[task_id] = _Lines(header_lines(self._fence_of(task_id)))
        current = otel_context.get_current()
        if current is not lines.context:  # what inject_headers gives one context, it caches
            trace: dict[str, str] = {}
            inject_headers(trace)
            lines.context, lines.trace = current, header_lines(trace)
        # A msg id is made of a task id (letters, digits, '-' and '_') and the event's kind
        # and index: nothing header_lines would need to clean.
        return header_block(lines.fence, _MSG_ID_LINE % msg_id.encode(), lines.trace)

    async def chunk(self, event: OutputEvent | TokenFrame) -> None:
        """Queue the event behind the task's earlier ones; returns once it is sent (or waits,
        in order, for the connection), not when it is stored.

        A token event (TokenFrame) goes out with the very bytes its runner wrote: index, text
        and time as the runner made them, fencing in headers. The codec writes one JSON for one
        event (orjson of the fields in order, floats and text round-tripping exactly), so these
        are the bytes re-encoding the decoded event gave before, without the model or the encode
        (~4.6 us an event; tests/worker/test_frames_as_written.py). Every other event is
        encoded: a seam's task_accepted is changed on the way, the rest are rare."""
        if isinstance(event, TokenFrame):
            body = event.body
        elif type(event) is TaskAccepted:
            body = encode_accepted(event)  # one a task, the codec's bytes without model_dump
        else:
            body = encode(event)
        msg_id = event_msg_id(event, self.fences.get(event.task_id, 0))
        await self.confirmed.send(
            event.task_id, subjects.out(event.task_id), body, self._headers(event.task_id, msg_id),
        )

    async def finish(self, event: TaskFinished) -> TaskFinished:
        """Store the terminal after every earlier event of the task; returns the terminal that
        was stored (`failed`/`output_lost` in place of a `completed` whose output is not whole).
        Raises BrokerUnavailable when the terminal itself cannot be stored: do not ack then."""
        task_id = event.task_id
        try:
            problem = await self.confirmed.settle(task_id)
            if self.confirmed.fenced(task_id):
                raise TaskFenced(f"task {task_id}: {problem}")
            if problem and event.status == "completed":
                event = await self._output_lost(event, problem)
            elif problem:
                log.warning("task %s ends %s with output missing: %s", task_id, event.status,
                            problem)
            if problem is None:
                await self._store_last(event)
                return event
            try:
                await js_publish(
                    self.js, subjects.out(task_id), event, msg_id=finished_msg_id(task_id),
                    budget_s=self.budget_s, extra_headers=self._fence_of(task_id),
                )
            except APIError as exc:
                if is_fenced(exc):
                    raise TaskFenced(f"task {task_id}: its terminal was refused") from None
                raise
            return event
        finally:
            self.forget(task_id)

    async def _store_last(self, event: TaskFinished) -> None:
        """The terminal of a task whose earlier events are stored whole: sent on the task's
        confirmed sequence and settled (a pipelined publish and its ack, no request, retry
        wrapper or task of its own: issue 23). The sequence was whole before it, so any
        problem now is the terminal's: fenced, TaskFenced; not stored, BrokerUnavailable."""
        task_id = event.task_id
        subject = subjects.out(task_id)
        body = encode(event)
        msg_id = finished_msg_id(task_id)
        with send_span(subject, msg_id, len(body)):  # its consumers' parent, as js_publish's
            await self.confirmed.send(task_id, subject, body, self._headers(task_id, msg_id))
            problem = await self.confirmed.settle(task_id)
        if self.confirmed.fenced(task_id):
            raise TaskFenced(f"task {task_id}: its terminal was refused")
        if problem is not None:
            raise BrokerUnavailable(f"task {task_id}: its terminal was not stored: {problem}")

    def _fence_of(self, task_id: str) -> dict[str, str]:
        return fence_headers(task_id, self.fences.get(task_id, 0))

    def forget(self, task_id: str) -> None:
        """Drop what this node kept of the task's output (ended, or given up)."""
        self.confirmed.forget(task_id)
        self.fences.pop(task_id, None)
        self._fenced.pop(task_id, None)
        self.taken_from.pop(task_id, None)

    async def _output_lost(self, event: TaskFinished, problem: str) -> TaskFinished:
        message = f"the task's output could not be stored whole: {problem}"
        # Made afresh: a tail the completed terminal carried is not stored (nothing follows
        # a hole as if the output were whole).
        log.error("task %s: %s; ending it failed (output_lost), not completed",
                  event.task_id, message)
        lost = failed(event.task_id, time.time(), ErrorReason.OUTPUT_LOST, message)
        lost = lost.model_copy(update={
            "usage": event.usage, "node_id": event.node_id, "runner_id": event.runner_id,
        })
        error = ErrorChunk(task_id=event.task_id, at=lost.at, reason=lost.reason or
                           ErrorReason.OUTPUT_LOST, message=message)
        with contextlib.suppress(Exception):  # the terminal below is what counts
            await js_publish(self.js, subjects.out(event.task_id), error,
                             msg_id=event_msg_id(error, self.fences.get(event.task_id, 0)),
                             budget_s=ERROR_CHUNK_BUDGET_S,
                             extra_headers=self._fence_of(event.task_id))
        return lost

    async def fail(
        self, task_id: str, reason: ErrorReason, message: str, *, node_id: str | None = None
    ) -> TaskFinished:
        now = time.time()
        if reason not in (ErrorReason.CANCELLED, ErrorReason.DEADLINE):
            await self.chunk(ErrorChunk(task_id=task_id, at=now, reason=reason, message=message))
        finished = failed(task_id, now, reason, message)
        if node_id:
            finished = finished.model_copy(update={"node_id": node_id})
        return await self.finish(finished)

    async def last_event(self, task_id: str) -> OutputEvent | None:
        """The newest event already published for a task (None when there is none).

        What this worker still has on the way for the task is settled first: a continuation
        must read back every event its earlier attempt sent, because token events are batched
        by timing and a continuation's batches need not start where a late one would land."""
        await self.confirmed.settle(task_id)
        return await self.log.last_event(task_id)

    async def close(self) -> None:
        await self.confirmed.close()
