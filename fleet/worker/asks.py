"""Request-reply on `fleet.ask.<model>`: `nats req fleet.ask.<model> '<task json>'` gets the
task's final answer instead of a PubAck.

Every worker answers in one queue group, so an ask is taken by one worker (any: the task
itself still goes through the model's queue, its claim, placement and continuations like any
other). The taker publishes the task on `fleet.tasks.<model>` with a `Fleet-Reply-To` inbox
(where a worker's claim refusal arrives), waits for its terminal on `fleet.out.<task_id>`, and
replies with one AskAnswer, or an AskError (refused, queue full, timeout, this worker
stopping). The wait costs a core subscription, no consumer: the events are watched live, and
the stored last event is looked at every few seconds in case a reconnect lost the live
terminal. Once FLEET_OUT holds the terminal (and so every event before it), the answer is
folded from the live events when they are provably whole (as many distinct events as
FLEET_OUT stored: one stream-info call), otherwise from the events read back from FLEET_OUT.

The reply subject is the asker's to choose and the worker's grants write it, so an ask is
answered only on an inbox (`_INBOX.<token>...`, fleet.bus.replies) and never on one of this
worker role's own (workers do not ask); an ask with any other reply is logged and dropped: no
task is published, nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any, Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from fleet.bus.connect import js_publish
from fleet.bus.replies import INBOX_ROOT, MAX_SUBJECT, inbox_reply
from fleet.bus.retry import STORE_FULL_ERR_CODES
from fleet.bus.task_log import TaskLog
from fleet.errors import FleetError, http_answer
from fleet.wire import subjects
from fleet.wire.ask import AskAnswer, AskError, AskErrorReason
from fleet.wire.codec import (
    DecodeError,
    decode_event,
    decode_events,
    decode_model,
    encode,
    expand_all,
)
from fleet.wire.events import ErrorReason, OutputEvent, TaskFinished, TaskRefused
from fleet.wire.tasks import Task
from fleet.worker.ask_answer import answer_of, ask_task, new_ask_id, seen_whole

log = logging.getLogger(__name__)

STORED_CHECK_S = 5.0  # how often the stored last event is looked at while waiting
SETTLE_S = 5.0  # how long a terminal seen live may take to be stored
SETTLE_FIRST_PAUSE_S = 0.005
MAX_OPEN_ASKS = 1024  # asks one worker waits on at once; more are answered `busy`
BROKER_BUDGET_S = 10.0  # an ask is answered within its timeout: broker retries stay short
# NATS services' convention for an error reply (the `nats` CLI prints these headers).
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"


class Owner(Protocol):
    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


class AskFailed(Exception):
    """An ask that gets an AskError instead of an answer."""

    def __init__(self, reply: AskError) -> None:
        super().__init__(reply.message)
        self.reply = reply


def _failed(reason: AskErrorReason, message: str, task_id: str | None = None) -> AskFailed:
    return AskFailed(AskError(task_id=task_id, reason=reason, message=message))


class AskResponder:
    """One worker's member of the `fleet-ask` queue group; each ask is a child of `owner`."""

    def __init__(self, nc: Client, js: JetStreamContext, timeout_s: float, owner: Owner) -> None:
        self.nc = nc
        self.js = js
        self.log = TaskLog(nc, js, budget_s=BROKER_BUDGET_S)  # an ask's retries stay short
        self.timeout_s = timeout_s
        self.owner = owner
        self.open: set[asyncio.Task[Any]] = set()
        self._subscription: Subscription | None = None
        # Its role never asks: an ask's answer never goes into this role's own inboxes (none
        # to keep out of on a connection without a role prefix, whose inboxes are anyone's).
        own = nc.new_inbox().rsplit(".", 1)[0]
        self.own_inboxes = own if own != INBOX_ROOT else None

    async def start(self) -> None:
        self._subscription = await self.nc.subscribe(
            subjects.ASK_ALL, queue=subjects.ASK_QUEUE, cb=self._take
        )

    async def close(self) -> None:
        """Take no new asks (the group's other members do); the open ones are answered
        `stopped` when the owner cancels them."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except (NatsError, OSError) as exc:
                log.warning("asks: could not leave the queue group: %r", exc)

    async def _take(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("asks: a message on %s without a reply subject: ignored (use "
                        "`nats req`, or publish on fleet.tasks.<model>)", msg.subject)
            return
        if inbox_reply(msg.reply, self.own_inboxes) is None:
            # The reply is a capability: answering `$KV...` or `fleet.out.<id>` would write
            # there with this worker's grants. Nothing is run and nothing is answered.
            log.warning("asks: refused an ask on %s whose reply subject %r is not an inbox "
                        "(_INBOX.<token>...) or is one of %s's", msg.subject,
                        msg.reply[:MAX_SUBJECT], self.own_inboxes)
            return
        if len(self.open) >= MAX_OPEN_ASKS:
            busy = AskError(reason="busy", message=f"this worker waits on {MAX_OPEN_ASKS} "
                            "asks already; retry, or publish on fleet.tasks.<model>")
            await self._reply(msg, busy)
            return
        task = self.owner.spawn(f"ask on {msg.subject}", self._answer(msg))
        self.open.add(task)
        task.add_done_callback(self.open.discard)

    async def _answer(self, msg: Msg) -> None:
        model = subjects.model_of_ask_subject(msg.subject)
        task_id: str | None = None
        try:
            task = self._task_of(model, msg.data)
            task_id = task.task_id
            reply: AskAnswer | AskError = await self._run(task)
        except AskFailed as failure:
            reply = failure.reply
        except asyncio.CancelledError:
            await self._reply(msg, AskError(
                task_id=task_id, reason="stopped",
                message="the answering worker stopped before the task ended; it goes on: "
                f"follow fleet.out.{task_id}" if task_id else "the answering worker stopped",
            ))
            raise
        await self._reply(msg, reply)

    def _task_of(self, model: str, body: bytes) -> Task:
        try:
            return ask_task(model, body, datetime.now(UTC), self.timeout_s, new_ask_id())
        except DecodeError as exc:
            raise _failed("invalid_task", str(exc), exc.task_id) from None

    async def _run(self, task: Task) -> AskAnswer:
        """Publish the task, wait for its terminal, fold its events into the answer: those
        seen live when they are the whole stored stream, else those read back."""
        arrived: asyncio.Queue[OutputEvent | TaskRefused] = asyncio.Queue()

        async def live(msg: Msg) -> None:
            try:
                arrived.put_nowait(decode_event(msg.data))
            except DecodeError:
                log.warning("asks: an undecodable event of task %s", task.task_id)

        async def refused(msg: Msg) -> None:
            try:
                arrived.put_nowait(decode_model(TaskRefused, msg.data))
            except DecodeError:
                log.warning("asks: an undecodable refusal for task %s", task.task_id)

        inbox = self.nc.new_inbox()
        # Both before the publish: the refusal and the first events may come at once.
        watches = [await self.nc.subscribe(subjects.out(task.task_id), cb=live),
                   await self.nc.subscribe(inbox, cb=refused)]
        try:
            await self._publish(task, inbox)
            seen = await self._until_finished(task, arrived)
        finally:
            for watch in watches:
                try:
                    await watch.unsubscribe()
                except (NatsError, OSError) as exc:
                    log.debug("asks: unsubscribe failed: %r", exc)
        await self._until_terminal_stored(task.task_id)
        # Seen as stored (a message each: seen_whole counts messages), answered expanded (a
        # terminal may carry the task's last token events, issue 23).
        whole = seen_whole(seen, await self.stored_count(task.task_id))
        answer = answer_of(task, expand_all(seen) if whole
                           else await self.stored_events(task.task_id))
        if answer is None:  # the terminal was seen, so it is stored: this is a broker fault
            raise _failed("unavailable", "the task ended but its stored events could not be "
                          f"read whole; follow fleet.out.{task.task_id}", task.task_id)
        if answer.reason == ErrorReason.MODEL_NOT_FOUND:  # refused, never run: a typed error
            raise _failed("model_not_found", answer.message or f"no model {task.model!r}",
                          task.task_id)
        return answer

    async def _publish(self, task: Task, inbox: str) -> None:
        try:
            published = await js_publish(
                self.js, subjects.tasks(task.model), task, msg_id=task.task_id,
                extra_headers={subjects.REPLY_HEADER: inbox}, budget_s=BROKER_BUDGET_S,
            )
        except APIError as exc:
            if exc.err_code in STORE_FULL_ERR_CODES:
                raise _failed("queue_full", f"the queue of model {task.model} is full; retry "
                              "later", task.task_id) from None
            raise _failed("unavailable", f"JetStream refused the task: {exc.description}",
                          task.task_id) from None
        except (FleetError, NatsError, OSError, TimeoutError) as exc:
            raise _failed("unavailable", f"could not publish the task: {exc}",
                          task.task_id) from None
        if published.duplicate:  # JetStream dropped it: the id's task message came before
            raise _failed("task_id_taken", f"task id {task.task_id!r} was published "
                          "already; a new task needs a new id", task.task_id)

    async def _until_finished(
        self, task: Task, arrived: asyncio.Queue[OutputEvent | TaskRefused]
    ) -> list[OutputEvent]:
        """The events seen live, once the task's terminal is seen or found stored."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.timeout_s
        seen: list[OutputEvent] = []
        while (left := give_up - loop.time()) > 0:
            try:
                item = await asyncio.wait_for(arrived.get(), min(left, STORED_CHECK_S))
            except TimeoutError:
                if await self._finished_stored(task.task_id):
                    return seen
                continue
            if isinstance(item, TaskRefused):
                raise _failed(item.reason, item.message, task.task_id)
            seen.append(item)
            if isinstance(item, TaskFinished):
                return seen
        raise _failed(
            "timeout", f"task {task.task_id} did not end within {self.timeout_s:g} s; it may "
            f"still run: follow fleet.out.{task.task_id}", task.task_id,
        )

    async def _until_terminal_stored(self, task_id: str) -> None:
        """Until FLEET_OUT holds the terminal: a core copy can arrive before the stream stored
        it, and only then does the stored stream hold every event (nothing follows it)."""
        pause = SETTLE_FIRST_PAUSE_S
        give_up = asyncio.get_running_loop().time() + SETTLE_S
        while not await self._finished_stored(task_id):
            if asyncio.get_running_loop().time() > give_up:
                return  # the read-back says what is missing
            await asyncio.sleep(pause)  # polling the broker, bounded by SETTLE_S
            pause = min(pause * 2, 0.2)

    async def _finished_stored(self, task_id: str) -> bool:
        try:
            last = await self.log.last_event(task_id)
        except (FleetError, NatsError, OSError, TimeoutError) as exc:
            log.warning("asks: %s; still waiting for task %s", exc, task_id)
            return False
        return isinstance(last, TaskFinished)

    async def stored_count(self, task_id: str) -> int:
        """How many events FLEET_OUT holds for the task (-1: unknown; then read them all)."""
        try:
            return await self.log.count(task_id)
        except (FleetError, NatsError, OSError, TimeoutError) as exc:
            log.warning("asks: %s; reading the events of task %s back", exc, task_id)
            return -1

    async def stored_events(self, task_id: str) -> list[OutputEvent]:
        """Every event FLEET_OUT holds for the task, in order (by sequence, no consumer),
        a terminal's last token events as events of their own."""
        try:
            stored = await self.log.raw(task_id, budget_s=BROKER_BUDGET_S)
        except (FleetError, NatsError, OSError, TimeoutError) as exc:
            raise _failed("unavailable", f"could not read the events of task {task_id}: "
                          f"{exc}", task_id) from None
        events: list[OutputEvent] = []
        for _, data in stored:
            try:
                events.extend(decode_events(data))
            except DecodeError:
                log.warning("asks: an undecodable stored event of task %s", task_id)
        return events

    async def _reply(self, msg: Msg, reply: AskAnswer | AskError) -> None:
        headers = None
        if isinstance(reply, AskError) or reply.status != "completed":  # every failure
            code, message = reply.reason or "internal", reply.message or reply.status
            headers = {ERROR_CODE_HEADER: str(http_answer(code).status),
                       ERROR_HEADER: " ".join(message.split())}
        if (inbox := inbox_reply(msg.reply, self.own_inboxes)) is None:  # checked in _take
            log.error("asks: no answer on %r: not an inbox", msg.reply)
            return
        try:
            # A core publish: the asker waits on its inbox; a retry cannot reach a requester
            # that has gone, and one that waits hears a broker outage as its own timeout.
            await self.nc.publish(inbox, encode(reply), headers=headers)
        except (NatsError, OSError) as exc:
            log.warning("asks: could not answer on %s: %r", msg.reply, exc)
