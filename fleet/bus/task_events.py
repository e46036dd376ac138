"""A task's events on `fleet.out.<task_id>`, read in order: one shared FLEET_OUT subscription
for a whole process (`EventHub`), one reader's view of one task (`TaskEvents`), and the events
of several tasks (`n` choices) as one (`ChoiceEvents`). The gateway relays them to HTTP
clients; `fleet follow` prints them.

A JetStream stream has a consumer limit (1,000 on FLEET_OUT), so one consumer per waiting
HTTP request let 1,000 idle requests stop every other chat. Instead the gateway holds ONE
ordered push consumer on `fleet.out.>` (new messages only) and demultiplexes by subject: a
waiting request costs a dict entry and a queue, not a consumer.

Each delivered message carries its stream sequence (in its `$JS.ACK` reply subject), so a
reader that also replays what was stored before it started listening (`TaskEvents`)
can stitch the two exactly: replay first, then live messages with a higher sequence.

One reader's view (`TaskEvents`): the stored events, then the live ones from the shared
subscription (or a subscription of its own, without a hub), from the task's first event or
after the N events a client has already seen, bounded by a deadline (and, for resumed
streams, an idle limit).

Events are numbered 1, 2, 3… within their task, so `after=N` means "I have seen N events".

Read in index order (`IndexOrder`): a task's output can be stored whole but out of order (a
re-send whose first ack was lost in a leader change lands after later tokens,
fleet.bus.confirmed), so a token or tool call stored ahead of its turn waits until the ones
before it arrive, and an error or the terminal lets out whatever still waits, in index order,
before itself. The rule depends only on the stored order, so a replaying reader and a live
one number the events alike, and `after=N` means the same to both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from fleet.errors import DeadlineExceeded, NatsUnavailable, StreamIdle, failure_of
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event, encode, expand
from fleet.wire.events import (
    ErrorChunk,
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)

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


@dataclass(frozen=True)
class Indexed:
    index: int  # 1-based position of the event within its task
    event: OutputEvent
    raw: bytes


Item = TypeVar("Item")


class IndexOrder(Generic[Item]):
    """Pure: one task's events in the order they were stored in, out in index order.

    Tokens and tool calls (each kind numbered from 0) go out in their index order: one stored
    ahead of its turn is held until the ones before it arrive (a token event of n tokens
    covers n indexes: the next one's turn is n further); one whose index went out already
    (a copy of an event stored twice) is dropped. An error or the terminal first lets out what
    is held (the output before it is all there is), then itself. A continuation's task_accepted
    (attempt > 0) drops the tokens held at or beyond its `continued_from`: they sat behind the
    hole that attempt resumes at, it produces those indexes again, and the earlier attempt (now
    fenced) can never fill the hole (fleet.bus.task_log). Any other event goes out as it
    comes. `Item` is what the caller keeps with each event (its raw bytes, its sequence)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # kind -> the index whose turn it is
        # kind -> index -> (item held back, how many indexes it covers)
        self._held: dict[str, dict[int, tuple[Item, int]]] = {}

    @property
    def holding(self) -> int:
        return sum(len(held) for held in self._held.values())

    def push(self, event: OutputEvent | None, item: Item) -> list[Item]:
        """What goes out now that `event` (None: undecodable, passed on) has arrived."""
        match event:
            case TokenChunk():  # one event may carry several tokens: it covers their indexes
                return self._indexed(event.type, event.index, item, event.count)
            case ToolCallChunk():
                return self._indexed(event.type, event.index, item)
            case ErrorChunk() | TaskFinished():
                return [*self.release(), item]
            case TaskAccepted(attempt=attempt, continued_from=resumed) if attempt > 0:
                self._supersede("token", resumed)
        return [item]

    def _supersede(self, kind: str, resumed: int) -> None:
        held = self._held.get(kind, {})
        for index in [i for i in held if i >= resumed]:
            log.debug("%s %d superseded by a continuation from %d", kind, index, resumed)
            del held[index]

    def _indexed(self, kind: str, index: int, item: Item, span: int = 1) -> list[Item]:
        turn = self._next.get(kind, 0)
        held = self._held.setdefault(kind, {})
        if index < turn or index in held:
            log.debug("%s %d stored twice: the later copy is skipped", kind, index)
            return []
        held[index] = (item, span)
        out: list[Item] = []
        while turn in held:
            ready, covered = held.pop(turn)
            out.append(ready)
            turn += covered
        self._next[kind] = turn
        return out

    def release(self) -> list[Item]:
        """Everything held, each kind in index order (a gap no later event will fill)."""
        out: list[Item] = []
        for kind, held in self._held.items():
            for index in sorted(held):
                ready, covered = held[index]
                out.append(ready)
                self._next[kind] = index + covered
            held.clear()
        return out


def commits_response(event: OutputEvent) -> bool:
    """Whether an HTTP response must be committed (headers sent) to pass this event on."""
    return isinstance(event, TokenChunk | ToolCallChunk | ImageChunk | TaskFinished)


class EventReader(ABC):
    """A request's events, one at a time or up to a point: one task's, or its choices'."""

    # Called once, as the first `task_accepted` is read: a runner took the request (its fair
    # share stops counting it as waiting, fleet.gateway.fair_share).
    on_running: Callable[[], None] | None = None

    def __aiter__(self) -> EventReader:
        return self

    def when_running(self, callback: Callable[[], None]) -> None:
        self.on_running = callback

    @abstractmethod
    async def __anext__(self) -> Indexed: ...

    def ready(self) -> bool:
        """Whether the next event is already here (reading it will not wait)."""
        return False

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
        self._order: IndexOrder[tuple[Delivered, OutputEvent | None]] = IndexOrder()
        self._ready: deque[tuple[Delivered, OutputEvent | None]] = deque()

    def unfinished(self) -> list[str]:
        return [] if self.finished is not None else [self.task_id]

    def ready(self) -> bool:
        if self.finished is not None or self._listener is None:
            return False
        return bool(self._ready or self._replayed) or not self._listener.queue.empty()

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
            message, event = await self._next_in_order()
            self.index += 1
            if event is None:
                continue  # undecodable: it keeps its place, so indexes agree with the store
            if isinstance(event, TaskFinished):
                self.finished = event
            elif isinstance(event, TaskAccepted) and self.on_running is not None:
                running, self.on_running = self.on_running, None
                running()
            if self.index <= self.after:
                if self.finished is not None:
                    raise StopAsyncIteration  # the client has seen everything already
                continue
            return Indexed(self.index, event, message.data)

    async def _next_in_order(self) -> tuple[Delivered, OutputEvent | None]:
        """The next event in index order (fleet.bus.task_events.IndexOrder)."""
        while not self._ready:
            message = await self._next_message()
            try:
                stored: OutputEvent | None = decode_event(message.data)
            except DecodeError as exc:
                log.warning("undecodable event of task %s: %s", self.task_id, exc)
                stored = None
            if type(stored) is TaskFinished and stored.last_tokens:
                # A terminal with its last token events (issue 23): each as the event it
                # stands for, with the bytes it would have been stored as on its own.
                for event in expand(stored):
                    alone = Delivered(message.seq, encode(event))
                    self._ready.extend(self._order.push(event, (alone, event)))
                continue
            self._ready.extend(self._order.push(stored, (message, stored)))
        return self._ready.popleft()

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


class ChoiceEvents(EventReader):
    """The events of several tasks as one iterator, like TaskEvents for one.

    It ends when every task has finished, or just after a task that failed (one failed choice
    fails the request; the caller cancels the rest, listed by `unfinished`). `finished` is that
    failure, or the last terminal event once all completed; None before.
    """

    def __init__(self, parts: Sequence[TaskEvents]) -> None:
        """`parts`: opened, one per choice, in choice order."""
        self.parts = list(parts)
        self.finished: TaskFinished | None = None
        self._done: set[str] = set()
        self._arrived: asyncio.Queue[Indexed | BaseException] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(part)) for part in self.parts]

    async def _pump(self, part: TaskEvents) -> None:
        try:
            async for item in part:
                self._arrived.put_nowait(item)
        except Exception as exc:  # a deadline or a lost connection ends the whole request
            self._arrived.put_nowait(exc)

    def unfinished(self) -> list[str]:
        return [part.task_id for part in self.parts if part.task_id not in self._done]

    def when_running(self, callback: Callable[[], None]) -> None:
        for part in self.parts:  # the first choice a runner takes
            part.when_running(callback)

    def ready(self) -> bool:
        return self.finished is None and not self._arrived.empty()

    async def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        for part in self.parts:
            await part.close()

    async def __anext__(self) -> Indexed:
        if self.finished is not None:
            raise StopAsyncIteration
        item = await self._arrived.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item.event, TaskFinished):
            self._done.add(item.event.task_id)
            if failure_of(item.event) is not None or len(self._done) == len(self.parts):
                self.finished = item.event
        return item
