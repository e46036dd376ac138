"""Every task's events through one shared JetStream subscription, handed out by task id.

A JetStream stream has a consumer limit (1,000 on FLEET_OUT), so one consumer per waiting
HTTP request let 1,000 idle requests stop every other chat. Instead the gateway holds ONE
ordered push consumer on `fleet.out.>` (new messages only) and demultiplexes by subject: a
waiting request costs a dict entry and a queue, not a consumer.

Each delivered message carries its stream sequence (in its `$JS.ACK` reply subject), so a
reader that also replays what was stored before it started listening (fleet.gateway.streams)
can stitch the two exactly: replay first, then live messages with a higher sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from fleet.errors import NatsUnavailable
from fleet.wire import subjects

log = logging.getLogger(__name__)

OUT_PREFIX = "fleet.out."
IDLE_HEARTBEAT_S = 5.0  # lets the ordered consumer notice it was lost and recreate itself
CLEANUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Delivered:
    seq: int  # stream sequence in FLEET_OUT
    data: bytes


@dataclass(eq=False)
class Listener:
    task_id: str
    queue: asyncio.Queue[Delivered] = field(default_factory=asyncio.Queue)
    first_seq: int | None = None  # the first live message's sequence: replay stops there


def task_of(subject: str) -> str | None:
    return subject[len(OUT_PREFIX) :] if subject.startswith(OUT_PREFIX) else None


def stream_seq(message: Msg) -> int:
    """The stream sequence of a message delivered by a JetStream push consumer."""
    return message.metadata.sequence.stream


class EventHub:
    """One subscription for all readers; `listen` before reading anything stored."""

    def __init__(
        self, client: Callable[[], Client], subject: str = f"{OUT_PREFIX}>",
        from_start: bool = False,
    ) -> None:
        """`subject`: what the one subscription covers; a lone reader of one task gives its
        subject and `from_start` (the stored events too, so it needs no replay)."""
        self._client = client
        self.subject = subject
        self.deliver = DeliverPolicy.ALL if from_start else DeliverPolicy.NEW
        self._listeners: dict[str, set[Listener]] = {}
        self._subscription: JetStreamContext.PushSubscription | None = None
        self._starting = asyncio.Lock()

    @property
    def listening(self) -> int:
        return sum(len(group) for group in self._listeners.values())

    async def ready(self) -> None:
        """Start the shared subscription once (again after a failure); raise if it cannot."""
        if self._subscription is not None:
            return
        async with self._starting:
            if self._subscription is not None:
                return
            try:
                self._subscription = await self._client().jetstream().subscribe(
                    self.subject,
                    stream=subjects.OUT_STREAM,
                    ordered_consumer=True,
                    deliver_policy=self.deliver,
                    idle_heartbeat=IDLE_HEARTBEAT_S,
                    cb=self._deliver,
                )
            except (NatsError, OSError, TimeoutError) as exc:
                raise NatsUnavailable(f"cannot read {subjects.OUT_STREAM}: {exc!r}") from None
            log.debug("reading task events through one subscription on %s", self.subject)

    async def _deliver(self, message: Msg) -> None:
        task_id = task_of(message.subject)
        group = self._listeners.get(task_id) if task_id else None
        if not group:
            return  # nobody is waiting for this task here
        delivered = Delivered(stream_seq(message), message.data)
        for listener in group:
            if listener.first_seq is None:
                listener.first_seq = delivered.seq
            listener.queue.put_nowait(delivered)

    def listen(self, task_id: str) -> Listener:
        listener = Listener(task_id)
        self._listeners.setdefault(task_id, set()).add(listener)
        return listener

    def drop(self, listener: Listener) -> None:
        group = self._listeners.get(listener.task_id)
        if group is None:
            return
        group.discard(listener)
        if not group:
            del self._listeners[listener.task_id]

    async def close(self) -> None:
        """Unsubscribe, even while the caller is being cancelled (a client hung up)."""
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(CLEANUP_TIMEOUT_S),
            contextlib.suppress(NatsError, OSError, TimeoutError),
        ):
            await subscription.unsubscribe()
