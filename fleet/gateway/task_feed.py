"""A gateway hears only the events of the tasks it reads: a core subscription on
`fleet.out.<task_id>` per task with a reader, with FLEET_OUT read back for what a subscription
cannot see (the events stored before it, and those published while the connection was down).

Before, one ordered consumer on `fleet.out.>` delivered every task's events to every gateway
(adding gateways added no capacity: each heard the whole fleet's tokens). A core subscription
costs the server an interest entry, not a consumer (FLEET_OUT's consumer limit is 1,000), and
a gateway receives exactly the events of its own requests and resumed streams.

A core message carries no stream sequence. Live messages are numbered from LIVE_BASE up (above
any stored sequence), so a reader (`StitchedEvents`) replays every stored event first and then
takes the live ones; a live copy of an event it replayed (published between the subscription
and the end of the replay) is recognised by its bytes and skipped (an event carries its task
id, its index and the time it was made: two distinct events never share bytes). After a
reconnect the subscriptions are made again by nats-py, and `refill` reads back from FLEET_OUT,
per task, what the subscription missed: each event not delivered yet goes to the readers, in
stored order, with the live ones that arrived meanwhile held until it is done.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from fleet.aio import started
from fleet.bus.task_events import (
    CLEANUP_TIMEOUT_S,
    Delivered,
    EventHub,
    Listener,
    TaskEvents,
    task_of,
)
from fleet.bus.task_log import TaskLog
from fleet.errors import NatsUnavailable
from fleet.wire import subjects

log = logging.getLogger(__name__)

LIVE_BASE = 1 << 62  # live messages are numbered from here: above every stored sequence
RECONNECT_CHECK_S = 0.5


def digest(data: bytes) -> int:
    """An event's identity, small enough to keep one per event of every task followed."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass
class Followed:
    """One task's subscription and what it has delivered (by digest), for the refill."""

    subscription: Subscription | None = None
    delivered: set[int] = field(default_factory=set)
    held: list[bytes] | None = None  # live messages held while a refill runs


def missing(stored: list[bytes], delivered: set[int]) -> list[bytes]:
    """Pure: the stored events (in stored order) that were not delivered yet."""
    return [data for data in stored if digest(data) not in delivered]


class TaskSubscriptions(EventHub):
    """EventHub's interface (ready, listen, drop, close), one core subscription per task."""

    def __init__(self, client: Callable[[], Client]) -> None:
        super().__init__(client)
        self._followed: dict[str, Followed] = {}
        self._numbers = itertools.count(LIVE_BASE)
        self._reconnects: int | None = None
        self._refill_due = False  # a read-back failed: tried again at the next check
        self.tap: Callable[[bytes], None] | None = None  # sees every event delivered here
        self._chores: set[asyncio.Task[None]] = set()  # unsubscribes and refills, owned here

    @property
    def following(self) -> int:
        return len(self._followed)

    async def ready(self) -> None:
        self._client()  # NatsUnavailable when not connected; nothing to set up

    async def follow(self, task_id: str) -> None:
        """Subscribe to the task's events (before its task is published, or its stored events
        read): the subscription stays while a reader listens, or until `unfollow`."""
        if task_id in self._followed:
            return
        followed = self._followed[task_id] = Followed()
        try:
            nc = self._client()
            if self._reconnects is None:
                self._reconnects = nc.stats.get("reconnects", 0)
            followed.subscription = await nc.subscribe(subjects.out(task_id), cb=self._on_message)
        except (NatsError, OSError, TimeoutError) as exc:
            del self._followed[task_id]
            raise NatsUnavailable(f"cannot follow task {task_id}: {exc!r}") from None

    async def _on_message(self, message: Msg) -> None:
        task_id = task_of(message.subject)
        followed = self._followed.get(task_id) if task_id else None
        if task_id is None or followed is None:
            return
        # The first message after a reconnect: what was published meanwhile is read back
        # before this one and the next ones are passed on (they are held until then).
        self._check_reconnects()
        if followed.held is not None:
            followed.held.append(message.data)
            return
        self._pass_on(task_id, followed, message.data)

    def _pass_on(self, task_id: str, followed: Followed, data: bytes) -> None:
        listeners = self._listeners.get(task_id, ())
        if not listeners:
            return  # not read yet: a reader that comes replays what is stored
        key = digest(data)
        if key in followed.delivered:
            return  # the refill delivered it already
        followed.delivered.add(key)
        if self.tap is not None:
            self.tap(data)
        delivered = Delivered(next(self._numbers), data)
        for listener in listeners:
            if listener.first_seq is None:
                listener.first_seq = delivered.seq
            listener.queue.put_nowait(delivered)

    def drop(self, listener: Listener) -> None:
        super().drop(listener)
        if listener.task_id not in self._listeners:
            self._unfollow_later(listener.task_id)

    def _unfollow_later(self, task_id: str) -> None:
        """drop() is synchronous (a reader closing): the unsubscribe runs beside it, owned
        here (awaited by close, its failure logged)."""
        followed = self._followed.pop(task_id, None)
        if followed is None or followed.subscription is None:
            return
        self._chore(_unsubscribe(followed.subscription, task_id))

    def _chore(self, work: Coroutine[Any, Any, None]) -> None:
        task = started(work, "task feed chore")
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def unfollow(self, task_id: str) -> None:
        """Stop following a task no reader listens to (a request that failed before its
        reader opened)."""
        if task_id not in self._listeners:
            self._unfollow_later(task_id)

    async def watch_reconnects(self) -> None:
        """Until cancelled (the backend owns it): notices a reconnect that no message of a
        followed task has shown yet (its terminal may have been published meanwhile)."""
        while True:
            await asyncio.sleep(RECONNECT_CHECK_S)  # the check's period
            self._check_reconnects()

    def _check_reconnects(self) -> None:
        try:
            count = self._client().stats.get("reconnects", 0)
        except NatsUnavailable:
            return  # still reconnecting: checked again by the next message or period
        if self._reconnects is None:
            self._reconnects = count
        if count == self._reconnects and not self._refill_due:
            return
        self._reconnects, self._refill_due = count, False
        log.info("reconnected: reading back the events of %d task(s)", len(self._followed))
        for followed in self._followed.values():
            if followed.held is None:
                followed.held = []
        self._chore(self._refill_all())

    async def _refill_all(self) -> None:
        for task_id in list(self._followed):
            try:
                await self.refill(task_id)
            except NatsUnavailable as exc:
                log.warning("events of task %s not read back: %s", task_id, exc.message)
                self._refill_due = True  # read back at the next check

    async def refill(self, task_id: str) -> None:
        """Pass on what FLEET_OUT holds for the task and its readers have not had, then what
        arrived live meanwhile."""
        followed = self._followed.get(task_id)
        if followed is None:
            return
        if followed.held is None:
            followed.held = []
        failure: NatsUnavailable | None = None
        try:
            stored = await read_stored(self._client(), task_id)
        except NatsUnavailable as exc:  # what was held still goes on; the gap is retried
            stored, failure = [], exc
        held, followed.held = followed.held, None
        for data in missing(stored, followed.delivered):
            self._pass_on(task_id, followed, data)
        for data in held:
            self._pass_on(task_id, followed, data)
        if failure is not None:
            raise failure

    async def close(self) -> None:
        followed, self._followed = self._followed, {}
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            for task_id, item in followed.items():
                if item.subscription is not None:
                    await _unsubscribe(item.subscription, task_id)
            for chore in list(self._chores):
                chore.cancel()
            await asyncio.gather(*self._chores, return_exceptions=True)


async def _unsubscribe(subscription: Subscription, task_id: str) -> None:
    try:
        await subscription.unsubscribe()
    except (NatsError, OSError, TimeoutError) as exc:  # gone with its connection anyway
        log.debug("unsubscribing from the events of task %s: %s", task_id, exc)


async def read_stored(nc: Client, task_id: str, after_seq: int = 0) -> list[bytes]:
    """Every event FLEET_OUT holds for the task, in stored order (the task log, one message at
    a time by sequence, no consumer); the reader puts them in index order."""
    return [data for _, data in await TaskLog(nc).raw(task_id, after_seq)]


class StitchedEvents(TaskEvents):
    """A reader over TaskSubscriptions: the stored events, then the live ones, with a live
    copy of a replayed event skipped by its bytes (live messages carry no sequence)."""

    async def open(self) -> StitchedEvents:
        await super().open()
        self._replayed_digests = {digest(d.data) for d in self._replayed}
        return self

    async def _next_message(self) -> Delivered:
        while True:
            message = await super()._next_message()
            if message.seq >= LIVE_BASE and self._replayed_digests:
                key = digest(message.data)
                if key in self._replayed_digests:
                    self._replayed_digests.discard(key)
                    continue
            return message
