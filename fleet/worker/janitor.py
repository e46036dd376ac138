"""Tasks no model consumer will ever finish: unknown models, tasks past MaxDeliver, and tasks
whose deadline passed while they waited in the queue.

Unknown models are found by the holder of the sweeper lease (fleet.worker.sweeper), which reads
FLEET_TASKS' per-subject counts every TRIAGE_S and reads back the tasks stored on a subject no
card or instance names; MaxDeliver advisories by the shared durable consumer `janitor` on
FLEET_ADVISORIES. Either way exactly one worker of the fleet answers each. A task body reaches
the workers once (the model's pull consumer): before, a queue-group subscription on
`fleet.tasks.>` delivered every task a second time to one worker, only to look at its subject.

Like the intake, the janitor writes a terminal on `fleet.out.<id>` only after claiming the id
(fleet.worker.claims): a task on an unknown model that carries another task's id is refused
(TaskRefused), never allowed to end that task. Every broker call goes through the retry
policy; the advisory's own ack or nak is retried, and a failure is logged, not suppressed.

Deadlines are kept by the broker (`DeadlineWatch`): the task's publisher set a sentinel whose
per-message TTL ends at the deadline (fleet.bus.deadlines); the server replaces it then with a
delete marker. The workers share one durable consumer of FLEET_DEADLINES: the worker that gets
a marker claims the task id; the claim succeeds only if no task message ever claimed it, i.e.
the task never started, and then that worker writes the `expired` terminal (reason
`deadline`). A task that started holds its claim, so its marker changes nothing; a task
message pulled after the marker is refused (`task_id_taken`) and never runs. A publisher that
also sets `Nats-TTL` on the task message (the gateway's batch lines do) has the broker drop
the message itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.aio import started
from fleet.bus.connect import js_publish
from fleet.bus.deadlines import STREAM as DEADLINES_STREAM
from fleet.bus.deadlines import expires, task_of
from fleet.bus.task_queue import TaskQueue, durable_pull, settle
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task, sent_task_id
from fleet.wire.events import ErrorReason, TaskFinished, failed
from fleet.worker.claims import Claims, one_off_owner
from fleet.worker.pulls import unsubscribe_pull

log = logging.getLogger(__name__)

TRIAGE_S = 1.0  # how soon a task of an unknown model is answered (and demand is seen)


def triage(counts: dict[str, int], is_known: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """Pure: of the task subjects with tasks stored, the models known (demand for them) and
    the subjects whose model is unknown (their tasks are answered and removed)."""
    known: list[str] = []
    unknown: list[str] = []
    for subject, count in sorted(counts.items()):
        model = subjects.model_of_task_subject(subject)
        if count > 0 and is_known(model):
            known.append(model)
        elif count > 0:
            unknown.append(subject)
    return known, unknown


def readable_task_id(data: bytes) -> str | None:
    try:
        return decode_task(data).task_id
    except DecodeError as exc:
        return exc.task_id


class Janitor:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        is_known: Callable[[str], bool],
        on_known: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        """`is_known(model)`: a card on this node or an instance placed anywhere;
        `on_known(model)`: told of each task for a known model (placement on demand)."""
        self.nc = nc
        self.js = js
        self.is_known = is_known
        self.on_known = on_known
        self.queue = TaskQueue(nc, js)

    async def start(self) -> None:
        self.claims = await Claims.open(self.nc, self.js)
        # Advisories are fire-and-forget; FLEET_ADVISORIES keeps them until a worker is there.
        self.advisories = await durable_pull(self.js, subjects.ADVISORIES_STREAM, "janitor",
                                             what="the janitor's advisories consumer")
        self._sweeper = started(self._sweep_forever(), "janitor sweep")

    async def stop(self) -> None:
        self._sweeper.cancel()
        await unsubscribe_pull(self.advisories)

    async def _sweep_forever(self) -> None:
        async for msgs in fetched_forever(self.advisories, 16, "advisory"):
            for msg in msgs:
                try:
                    await self._dead(msg)
                except Exception as exc:
                    log.warning("dead letter handling failed, retrying later: %s", exc)
                    await self._settle(msg, "nak", partial(msg.nak, delay=2.0))
                    continue
                await self._settle(msg, "ack", msg.ack)

    async def _settle(self, msg: Msg, verb: str, call: Callable[[], Awaitable[None]]) -> None:
        try:
            await settle(call, what=f"{verb} of advisory on {msg.subject}")
        except Exception as exc:  # the advisory comes back after AckWait: say so, go on
            log.warning("advisory %s failed (%s: %s); it will be redelivered",
                        verb, type(exc).__name__, exc)

    async def _finish(self, task_id: str, reason: ErrorReason, message: str) -> None:
        event = failed(task_id, time.time(), reason, message)
        # Retried inside js_publish; the msg id makes a retried publish a no-op.
        await js_publish(self.js, subjects.out(task_id), event, msg_id=f"finished-{task_id}")

    async def triage_forever(self) -> None:
        """Until cancelled (a duty of the sweeper lease's holder)."""
        while True:
            try:
                await self.triage_queued()
            except Exception as exc:  # the next period tries again
                log.warning("triage of queued tasks failed: %s", exc)
            await asyncio.sleep(TRIAGE_S)  # the triage's period

    async def triage_queued(self) -> None:
        known, unknown = triage(await self.queue.counts(), self.is_known)
        if self.on_known is not None:
            for model in known:
                try:
                    await self.on_known(model)
                except Exception as exc:
                    log.warning("placing %s on demand failed: %s", model, exc)
        for subject in unknown:
            await self._unknown(subject)

    async def _unknown(self, subject: str) -> None:
        """Answer every task stored on a subject no model consumer reads, then remove them
        (up to the last one answered: a task published meanwhile waits for the next round)."""
        model = subjects.model_of_task_subject(subject)
        last = 0
        while (stored := await self.queue.next_on(subject, last)) is not None:
            last = stored.seq or last + 1
            await self._answer_unknown(model, stored.data or b"", stored.headers, subject)
        if last:
            await self.queue.purge_through(subject, last)

    async def _answer_unknown(self, model: str, data: bytes, headers: dict[str, str] | None,
                              subject: str) -> None:
        task_id = readable_task_id(data)
        log.warning("task %s names unknown model %r", task_id, model)
        # As the message was stored: claims read its Fleet-Reply-To header
        msg = Msg(self.nc, subject=subject, data=data, headers=headers)
        unknown = f"no model named {model!r}"
        if task_id is None:
            await self.claims.refuse(
                msg, model, sent_task_id(data), "invalid_task_id",
                f"{unknown}, and the task has no usable task_id",
            )
        elif refused := await self.claims.admit(task_id, one_off_owner()):
            await self.claims.refuse(msg, model, task_id, refused)
        else:
            await self._finish(task_id, ErrorReason.MODEL_NOT_FOUND, unknown)

    async def _dead(self, msg: Msg) -> None:
        """Move a task past MaxDeliver out of the work queue, record it, and finish it."""
        advisory = orjson.loads(msg.data)
        seq = advisory.get("stream_seq")
        if not seq:
            return
        try:
            stored = await self.queue.get(seq)
        except Exception as exc:
            log.warning("dead letter %s already gone: %s", seq, exc)
            return
        data = stored.data or b""
        model = subjects.model_of_task_subject(stored.subject or "")
        deliveries = advisory.get("deliveries")
        await self.queue.dead_letter(model, data, seq, deliveries)
        task_id = readable_task_id(data)
        # Only the message that owns the id may end it (its claim holds this sequence).
        owns = task_id is not None and await self.claims.admit(task_id, str(seq)) is None
        if task_id and owns and not await self._already_finished(task_id):
            await self._finish(
                task_id, ErrorReason.MAX_DELIVERIES,
                f"delivered {deliveries} times without finishing; moved to fleet.dead.{model}",
            )
        await self.queue.delete(seq)

    async def _already_finished(self, task_id: str) -> bool:
        last = await self.claims.log.last_event(task_id)  # the terminal is stored last
        return isinstance(last, TaskFinished)


DEADLINES_DURABLE = "deadlines"


class DeadlineWatch:
    def __init__(self, nc: Client, js: JetStreamContext, janitor: Janitor) -> None:
        """`janitor`: writes the terminal (as it writes its own)."""
        self.nc = nc
        self.js = js
        self.janitor = janitor

    async def start(self) -> None:
        self.claims = await Claims.open(self.nc, self.js)
        self.markers = await durable_pull(self.js, DEADLINES_STREAM, DEADLINES_DURABLE,
                                          what="the deadline markers' consumer")
        self._loop = started(self._expire_forever(), "deadline watch")

    async def stop(self) -> None:
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop
        await unsubscribe_pull(self.markers)

    async def _expire_forever(self) -> None:
        async for msgs in fetched_forever(self.markers, 32, "deadline marker"):
            for msg in msgs:
                try:
                    if expires(msg.headers):
                        await self._expire(task_of(msg.subject))
                    await msg.ack()
                except Exception as exc:  # redelivered after AckWait; the claim keeps it once
                    log.warning("expiring %s failed, retried later: %s", msg.subject, exc)

    async def _expire(self, task_id: str) -> None:
        # One owner per task for every marker of it: a marker redelivered after a failed
        # terminal finds its own claim and writes the terminal (its msg id keeps it once).
        if await self.claims.admit(task_id, f"deadline-{task_id}") is not None:
            return  # it started (its message holds the claim), or it was expired already
        log.info("task %s expired unstarted: its deadline passed in the queue", task_id)
        await self.janitor._finish(task_id, ErrorReason.DEADLINE,
                                   "the deadline passed before it started (expired in the queue)")


async def fetched_forever(sub: JetStreamContext.PullSubscription, batch: int, what: str
                          ) -> AsyncIterator[list[Msg]]:
    """Each non-empty fetch of a pull consumer, for ever: an empty wait is retried at once,
    a broker error logged and retried a second later."""
    while True:
        try:
            yield await sub.fetch(batch, timeout=5.0)
        except TimeoutError:
            continue
        except Exception as exc:
            log.warning("%s fetch failed: %s", what, exc)
            await asyncio.sleep(1.0)  # pacing a retry after a broker error
