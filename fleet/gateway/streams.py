"""One request's view of `fleet.out.<task_id>`: an ordered consumer over FLEET_OUT, from the
task's first event or after the N events a client has already seen, bounded by a deadline.

Events are numbered 1, 2, 3… within their task, so `after=N` means "I have seen N events".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import anyio
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from fleet.errors import DeadlineExceeded, NatsUnavailable
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event
from fleet.wire.events import ImageChunk, OutputEvent, TaskFinished, TokenChunk, ToolCallChunk

log = logging.getLogger(__name__)

# Server-side heartbeats let the ordered consumer notice a lost consumer and recreate it.
IDLE_HEARTBEAT_S = 5.0
CLEANUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Indexed:
    index: int  # 1-based position of the event within its task
    event: OutputEvent
    raw: bytes


def commits_response(event: OutputEvent) -> bool:
    """Whether an HTTP response must be committed (headers sent) to pass this event on."""
    return isinstance(event, TokenChunk | ToolCallChunk | ImageChunk | TaskFinished)


class EventReader(ABC):
    """A request's events, one at a time or up to a point: one task's, or its choices'."""

    def __aiter__(self) -> EventReader:
        return self

    @abstractmethod
    async def __anext__(self) -> Indexed: ...

    async def until_committed(self) -> list[Indexed]:
        """Read up to the first event that needs a committed response (or the end)."""
        seen: list[Indexed] = []
        async for item in self:
            seen.append(item)
            if commits_response(item.event):
                break
        return seen

    async def rest(self) -> list[Indexed]:
        return [item async for item in self]


class TaskEvents(EventReader):
    """Async iterator of one task's events; ends after its TaskFinished.

    Raises DeadlineExceeded when `deadline` (event-loop time) passes first.
    """

    def __init__(self, js: JetStreamContext, task_id: str, deadline: float, after: int = 0) -> None:
        self.js = js
        self.task_id = task_id
        self.deadline = deadline
        self.after = after
        self.index = 0
        self.finished: TaskFinished | None = None
        self._subscription: JetStreamContext.PushSubscription | None = None
        # Fed by a callback: nats-py's next_msg makes a task and a uuid per message, which
        # costs more than the rest of the relay of a token.
        self._arrived: asyncio.Queue[Msg] = asyncio.Queue()

    def unfinished(self) -> list[str]:
        return [] if self.finished is not None else [self.task_id]

    async def _receive(self, message: Msg) -> None:
        self._arrived.put_nowait(message)

    async def open(self) -> TaskEvents:
        try:
            self._subscription = await self.js.subscribe(
                subjects.out(self.task_id),
                stream=subjects.OUT_STREAM,
                ordered_consumer=True,
                idle_heartbeat=IDLE_HEARTBEAT_S,
                cb=self._receive,
            )
        except (NatsError, OSError) as exc:
            raise NatsUnavailable(f"cannot read {subjects.OUT_STREAM}: {exc!r}") from None
        return self

    async def close(self) -> None:
        """Unsubscribe even when the caller is being cancelled (a client hung up)."""
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(CLEANUP_TIMEOUT_S),
            contextlib.suppress(NatsError, OSError),
        ):
            await subscription.unsubscribe()

    async def __aenter__(self) -> TaskEvents:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def __anext__(self) -> Indexed:
        if self.finished is not None or self._subscription is None:
            raise StopAsyncIteration
        while True:
            message = await self._next_message()
            self.index += 1
            try:
                event = decode_event(message.data)
            except DecodeError as exc:
                log.warning("undecodable event %d of task %s: %s", self.index, self.task_id, exc)
                continue
            if isinstance(event, TaskFinished):
                self.finished = event
            if self.index <= self.after:
                if self.finished is not None:
                    raise StopAsyncIteration  # the client has seen everything already
                continue
            return Indexed(self.index, event, message.data)

    async def _next_message(self) -> Msg:
        if not self._arrived.empty():
            return self._arrived.get_nowait()
        try:
            async with asyncio.timeout_at(self.deadline):
                return await self._arrived.get()
        except TimeoutError:
            raise DeadlineExceeded(f"task {self.task_id} did not finish in time") from None

