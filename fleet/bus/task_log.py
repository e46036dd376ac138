"""A task's log: its events on `fleet.out.<task_id>` in FLEET_OUT, read through one facade.

Readers of a task's stored output ask this module (the worker's continuation read-back and its
last-event check, the gateway's resume check); live readers go through
fleet.bus.task_events.TaskEvents, which applies the same ordering rule (`IndexOrder`) as it
reads. Writing stays with the worker's TaskOutput (fleet.worker.outputs): confirmed, ordered
appends, fenced, with one terminal per task.

What a reader gets: the stream's order is the order the server stored the events in, which is
not always the order they were produced in:
- a re-send whose first ack was lost in a leader change (or a reconnect flushing nats-py's
  pending buffer) lands after later tokens: the same event, out of place (fleet.bus.confirmed);
- a continuation (an attempt that took the task over, fleet.worker.takeover) resumes at the
  first index missing from the contiguous run from 0 (fleet.worker.continuation); tokens the
  earlier attempt had stored beyond that hole are *superseded*: the continuation produces those
  indexes again, from its own context, and they may be batched (coalesced) differently.
Every token and tool-call event carries its index (a token event covers `count` indexes), and
every attempt's task_accepted says where it resumed (`continued_from`), so `ordered` recovers
the produced order from the stored order alone: a reader of the raw stream (the NATS CLI, any
client) does the same by sorting token events by index, keeping the first copy of an index,
and, at a task_accepted with attempt > 0, forgetting tokens it holds at or beyond that accept's
`continued_from` that have not come out yet (they sat behind the hole the continuation fills).
A `task_finished` that carries `last_tokens` (issue 23) stands for those token events, in
order, then the terminal without them: every reader here expands it first (fleet.wire.codec
`decode_events`), and a raw reader does the same before anything else.

Each call has its own retry budget (`budget_s`): a broker election delays a read, a longer
outage raises BrokerUnavailable (fleet.bus.retry).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from functools import partial

import orjson
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from fleet.bus.chunks import read_in_order
from fleet.bus.pipelined import pipelined_for
from fleet.bus.retry import BROKER_BUDGET_S, with_retry
from fleet.bus.task_events import IndexOrder
from fleet.errors import NatsUnavailable
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event, decode_events, encode, expand
from fleet.wire.events import OutputEvent, TaskFence

log = logging.getLogger(__name__)

READ_IDLE_S = 10.0  # a read-back that receives nothing for this long fails
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
NOT_FOUND = 404  # a message-get answer: no such message (or no such stream)


def holds_message(answer: bytes) -> bool:
    """Pure. A message-get answer (`$JS.API.STREAM.MSG.GET`): True when it carries a message,
    False when it says not found (404: no message, or no stream, as get_last_msg's
    NotFoundError); any other error is raised as nats-py's typed APIError (a 503 is
    transient to the retry policy)."""
    reply = orjson.loads(answer)
    error = reply.get("error")
    if error is None:
        return "message" in reply
    if error.get("code") == NOT_FOUND:
        return False
    APIError.from_error(error)  # raises the typed error of its code
    raise APIError(**error)


def fence_subject(task_id: str) -> str:
    """One token below the task's events, so no reader of `fleet.out.<id>` or `fleet.out.*`
    sees it, and still in FLEET_OUT (`fleet.out.>`), where the expected-sequence check runs
    (fleet.worker.takeover)."""
    return f"{subjects.out(task_id)}.fence"


def ordered(events: Iterable[OutputEvent], *, release_held: bool = False) -> list[OutputEvent]:
    """Pure: a task's events in stored order, out in index order (`IndexOrder`): a copy of an
    index already out is dropped, a continuation's accept drops the earlier attempt's tokens
    behind the hole it resumes at. Tokens still waiting behind a hole at the end are left out
    (the contiguous run is what a reader has seen), unless `release_held` (a finished task
    releases them at its terminal anyway)."""
    order: IndexOrder[OutputEvent] = IndexOrder()
    out: list[OutputEvent] = []
    for event in events:
        out.extend(order.push(event, event))
    if release_held:
        out.extend(order.release())
    return out


class TaskLog:
    """FLEET_OUT as a log of tasks, over one connection."""

    def __init__(self, nc: Client, js: JetStreamContext | None = None,
                 *, budget_s: float = BROKER_BUDGET_S) -> None:
        self.nc = nc
        self.js = js or nc.jetstream()
        self.budget_s = budget_s

    @classmethod
    def of(cls, js: JetStreamContext, *, budget_s: float = BROKER_BUDGET_S) -> TaskLog:
        """The log over the connection `js` was made from (nats-py keeps it as `_nc`)."""
        return cls(js._nc, js, budget_s=budget_s)

    async def count(self, task_id: str, *, budget_s: float | None = None) -> int:
        """How many events the stream holds for the task (every copy, in any order)."""
        subject = subjects.out(task_id)

        async def once() -> int:
            info = await self.js.stream_info(subjects.OUT_STREAM, subjects_filter=subject)
            return int((info.state.subjects or {}).get(subject, 0))

        return await with_retry(once, what=f"count the stored events of {task_id}",
                                budget_s=self._budget(budget_s))

    async def last_event(self, task_id: str, *, budget_s: float | None = None
                         ) -> OutputEvent | None:
        """The event stored last for the task (None when none is, or it is undecodable).
        Stored last, not produced last: enough to tell whether output began or ended."""
        subject = subjects.out(task_id)

        async def once() -> OutputEvent | None:
            try:
                raw = await self.js.get_last_msg(subjects.OUT_STREAM, subject)
            except NotFoundError:
                return None
            try:
                return expand(decode_event(raw.data or b""))[-1]
            except DecodeError:
                log.warning("undecodable event on %s", subject)
                return None

        return await with_retry(once, what=f"read the last event of {task_id}",
                                budget_s=self._budget(budget_s))

    def events_lookup(self, task_id: str) -> tuple[str, bytes]:
        """The raw request `has_events` sends (subject, body); its answer is read by
        `holds_message` (fleet.worker.claims sends it ahead of the intake)."""
        api = f"{self.js._prefix}.STREAM.MSG.GET.{subjects.OUT_STREAM}"
        return api, orjson.dumps({"last_by_subj": subjects.out(task_id)})

    async def has_events(self, task_id: str, *, budget_s: float | None = None) -> bool:
        """Whether the stream holds any event of the task. Asked for every task taken in
        (its claim's look-up), so asked raw and read for found or not only (`holds_message`):
        nats-py's get_last_msg parses the answer with the standard json, raises NotFoundError
        for the usual answer (none: a fresh task), and decodes a found message (issue 23)."""
        api, request = self.events_lookup(task_id)
        try:  # one pipelined publish (fleet.bus.pipelined); anything but an answer: retried
            return holds_message((await pipelined_for(self.nc).request(api, request)).data)
        except Exception as exc:
            log.debug("task %s: the events look-up's fast path failed (%r)", task_id, exc)

        async def once() -> bool:
            try:
                answer = await self.nc.request(api, request, timeout=self.js._timeout)
            except NoRespondersError:
                raise ServiceUnavailableError from None  # as nats-py's API calls: transient
            return holds_message(answer.data)

        return await with_retry(once, what=f"look for events of task {task_id}",
                                budget_s=self._budget(budget_s))

    async def last_fence(self, task_id: str, *, budget_s: float | None = None
                         ) -> tuple[int, TaskFence | None]:
        """The task's last fence: its stream sequence (0: none) and the fence (None when
        none, or undecodable)."""
        subject = fence_subject(task_id)

        async def once() -> tuple[int, TaskFence | None]:
            try:
                raw = await self.js.get_last_msg(subjects.OUT_STREAM, subject)
            except NotFoundError:
                return 0, None
            try:
                return raw.seq or 0, TaskFence.model_validate_json(raw.data or b"")
            except ValueError:
                log.warning("undecodable fence on %s", subject)
                return raw.seq or 0, None

        return await with_retry(once, what=f"read the fence {subject}",
                                budget_s=self._budget(budget_s))

    async def put_fence(self, fence: TaskFence, last_seq: int, *,
                        budget_s: float | None = None) -> int:
        """Write `fence` only if the task's last fence is still at `last_seq` (compare-and-
        set); its stream sequence. A fence written meanwhile fails it with JetStream's 10071
        (an APIError, not retried)."""
        body = encode(fence)
        headers = {EXPECTED_LAST_SUBJECT_SEQ: str(last_seq)}
        subject = fence_subject(fence.task_id)
        ack = await with_retry(lambda: self.js.publish(subject, body, headers=headers),
                               what=f"fence task {fence.task_id}",
                               budget_s=self._budget(budget_s))
        return int(ack.seq)

    async def stored(self, task_id: str, *, budget_s: float | None = None
                     ) -> list[OutputEvent]:
        """Every event stored for the task, in stored order (undecodable ones skipped)."""
        total = await self.count(task_id, budget_s=budget_s)
        subject = subjects.out(task_id)
        events: list[OutputEvent] = []
        if total == 0:
            return events
        # delete=False: the worker role may not delete FLEET_OUT consumers
        # (docs/permissions.md); the server drops the reader's consumer when it goes idle.
        reader = read_in_order(self.nc, self.js, subjects.OUT_STREAM, subject, READ_IDLE_S,
                               count=total, delete=False)
        async with contextlib.aclosing(reader) as messages:
            async for data in messages:
                try:
                    events.extend(decode_events(data))
                except DecodeError:
                    log.warning("undecodable stored event on %s", subject)
        return events

    async def raw(self, task_id: str, after_seq: int = 0, *, budget_s: float | None = None
                  ) -> list[tuple[int, bytes]]:
        """The task's stored messages after stream sequence `after_seq` as (sequence, bytes), in
        stored order, one get by sequence at a time (no consumer): for a reader that stitches
        them to a live subscription and orders them itself (IndexOrder), or that must not
        open a consumer (an ask). Without `budget_s` no retry: such a reader fails with
        NatsUnavailable and its client resumes; with one, each get is retried within it."""
        return [(msg.seq or 0, msg.data or b"")
                async for msg in self.each(task_id, after_seq, budget_s=budget_s)]

    async def each(self, task_id: str, after_seq: int = 0, *,
                   budget_s: float | None = None) -> AsyncIterator[RawStreamMsg]:
        """`raw` one message at a time, with its headers, for a reader that may stop early (a
        trace lookup stops at the task's accept, and reads the `traceparent` header:
        fleet.trace.lookup)."""
        subject = subjects.out(task_id)
        cursor = after_seq + 1
        while True:
            get = partial(self.js.get_msg, subjects.OUT_STREAM, seq=cursor, subject=subject,
                          next=True)
            try:
                if budget_s is None:
                    stored = await get()
                else:
                    stored = await with_retry(get, what=f"read the events of task {task_id}",
                                              budget_s=budget_s)
            except NotFoundError:
                return
            except (NatsError, OSError, TimeoutError) as exc:
                raise NatsUnavailable(f"cannot read {subjects.OUT_STREAM}: {exc!r}") from None
            yield stored
            cursor = (stored.seq or cursor) + 1

    async def read(self, task_id: str, *, budget_s: float | None = None) -> list[OutputEvent]:
        """The task's events in index order (`ordered`): what a client reading it has seen."""
        return ordered(await self.stored(task_id, budget_s=budget_s))

    def _budget(self, budget_s: float | None) -> float:
        return self.budget_s if budget_s is None else budget_s
