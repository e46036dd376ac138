"""One request's view of `fleet.out.<task_id>`: the stored events, then the live ones from the
gateway's shared subscription, from the task's first event or after the N events a client has
already seen, bounded by a deadline (and, for resumed streams, an idle limit).

Events are numbered 1, 2, 3… within their task, so `after=N` means "I have seen N events".
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from fleet.errors import DeadlineExceeded, NatsUnavailable
from fleet.gateway.hub import Delivered, EventHub, Listener
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event
from fleet.wire.events import ImageChunk, OutputEvent, TaskFinished, TokenChunk, ToolCallChunk

log = logging.getLogger(__name__)


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


class StreamIdle(DeadlineExceeded):
    """An event stream that saw nothing for its idle limit (a resume of a quiet task)."""

    code = "idle"


class TaskEvents(EventReader):
    """Async iterator of one task's events; ends after its TaskFinished.

    Live events come from the gateway's shared subscription (EventHub). With `replay`, what
    FLEET_OUT stored before this reader started listening is read first, one message at a time
    by sequence (no consumer), and live events at or below the last replayed sequence are
    skipped: nothing is missed or seen twice. A task id the gateway just made has nothing
    stored, so its reader skips the replay.

    Raises DeadlineExceeded when `deadline` (event-loop time) passes first, StreamIdle when
    `idle_s` passes without an event.
    """

    def __init__(
        self,
        js: JetStreamContext,
        task_id: str,
        deadline: float,
        after: int = 0,
        *,
        hub: EventHub | None = None,
        replay: bool = True,
        idle_s: float | None = None,
    ) -> None:
        """`hub`: the gateway's shared subscription. Without one (a lone reader such as
        `fleet follow`) the reader makes its own from the task's first stored event, on the
        task's subject only, and needs no replay."""
        self._own_hub = hub is None
        # nats-py keeps the connection of a JetStream context only as `_nc`
        self.hub = hub or EventHub(lambda: js._nc, subjects.out(task_id), from_start=True)
        self.js = js
        self.task_id = task_id
        self.deadline = deadline
        self.after = after
        self.replay = replay and not self._own_hub
        self.idle_s = idle_s
        self.index = 0
        self.finished: TaskFinished | None = None
        self._listener: Listener | None = None
        self._replayed: list[Delivered] = []
        self._last_seq = 0

    def unfinished(self) -> list[str]:
        return [] if self.finished is not None else [self.task_id]

    async def open(self) -> TaskEvents:
        await self.hub.ready()
        self._listener = self.hub.listen(self.task_id)
        if self.replay:
            try:
                self._replayed = await self._stored()
            except BaseException:
                await self.close()
                raise
        return self

    async def _stored(self) -> list[Delivered]:
        """What FLEET_OUT holds for this task, up to where the live subscription took over."""
        assert self._listener is not None
        subject = subjects.out(self.task_id)
        found: list[Delivered] = []
        cursor = 1
        while True:
            first_live = self._listener.first_seq
            try:
                stored = await self.js.get_msg(
                    subjects.OUT_STREAM, seq=cursor, subject=subject, next=True
                )
            except NotFoundError:
                return found
            except (NatsError, OSError, TimeoutError) as exc:
                raise NatsUnavailable(f"cannot read {subjects.OUT_STREAM}: {exc!r}") from None
            seq = stored.seq or cursor
            if first_live is not None and seq >= first_live:
                return found  # from here on the live queue has it
            found.append(Delivered(seq, stored.data or b""))
            cursor = seq + 1

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            self.hub.drop(listener)
        if self._own_hub:
            await self.hub.close()

    async def __aenter__(self) -> TaskEvents:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def __anext__(self) -> Indexed:
        if self.finished is not None or self._listener is None:
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

    async def _next_message(self) -> Delivered:
        while True:
            if self._replayed:
                message = self._replayed.pop(0)
            else:
                message = await self._next_live()
            if message.seq > self._last_seq:  # a live copy of a replayed event is skipped
                self._last_seq = message.seq
                return message

    async def _next_live(self) -> Delivered:
        assert self._listener is not None
        queue = self._listener.queue
        if not queue.empty():
            return queue.get_nowait()
        loop = asyncio.get_running_loop()
        idle_until = loop.time() + self.idle_s if self.idle_s is not None else None
        until = min(self.deadline, idle_until) if idle_until is not None else self.deadline
        try:
            async with asyncio.timeout_at(until):
                return await queue.get()
        except TimeoutError:
            if idle_until is not None and idle_until < self.deadline:
                raise StreamIdle(
                    f"no event of task {self.task_id} for {self.idle_s:g} s; resume with "
                    f"after={self.index}"
                ) from None
            raise DeadlineExceeded(f"task {self.task_id} did not finish in time") from None
