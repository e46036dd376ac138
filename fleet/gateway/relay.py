"""One request's life: subscribe to the task's events, publish the task, then answer with one
JSON body or an SSE stream, cancel the task when nobody will read its output; and the resume
of a task's raw events.

A failure that is known before the first token becomes an HTTP error with the right status;
once a stream has started it becomes an SSE `error` event.

Resume (GET /v1/tasks/{id}/events): a task's raw Fleet events, resumable by index. Only the
tenant that made a task may read it (another tenant gets the same 404 as an unknown
id); the stream holds a place in the gateway's capacity (429 when full) and ends after its
idle time with an in-band `error` event whose code is `idle`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from fleet.bus.task_events import ChoiceEvents, Indexed, TaskEvents
from fleet.errors import FleetError, failure_of
from fleet.gateway.backend import Backend
from fleet.gateway.capacity import Capacity
from fleet.gateway.errors import counted_error_response
from fleet.gateway.observability import GatewayMetrics, TaskObserver
from fleet.gateway.sse import EventStream, sse, sse_error, unless_hung_up
from fleet.gateway.token_runs import MAX_RUN, joins, mergeable, merged
from fleet.wire.events import (
    ErrorChunk,
    ImageChunk,
    OutputEvent,
    TaskFinished,
)
from fleet.wire.records import TaskRecord
from fleet.wire.tasks import Task


class Renderer(Protocol):
    async def body(self, events: list[OutputEvent]) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    async def lines(self, item: Indexed) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...

    def failed(self, exc: FleetError) -> list[bytes]:
        """The lines that end a stream that failed after it began (an `error` event, unless
        the API has a way of its own)."""
        ...


# sse and sse_error are the kit's (fleet.gateway.sse), imported from here by the renderers too.
__all__ = ["SSE_DONE", "EventStream", "Renderer", "claimer", "run_task", "sse", "sse_error"]

SSE_DONE = b"data: [DONE]\n\n"
MAX_LINES_A_WRITE = 64


Events = TaskEvents | ChoiceEvents


Claim = Callable[[Indexed], Awaitable[None]]


CLIENT_CLOSED_REQUEST = 499  # nobody reads it; /metrics counts it


def merges_tokens(renderer: Renderer) -> bool:
    """Whether the renderer takes token events that arrived together as one
    (fleet.gateway.token_runs): a renderer says so with `merges_tokens = True`."""
    return getattr(renderer, "merges_tokens", False) is True


async def _relay(
    head: list[Indexed], events: Events, renderer: Renderer, observers: Observers,
    claim: Claim,
) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    last_error: ErrorChunk | None = None
    merging = merges_tokens(renderer)

    async def each() -> AsyncIterator[tuple[Indexed, bool]]:
        """Each item, and whether the next one is here already (reading it will not wait)."""
        for n, item in enumerate(head):
            yield item, n + 1 < len(head) or events.ready()
        async for item in events:
            yield item, events.ready()

    for line in renderer.opening():
        yield line
    # The SSE lines of events that arrived together leave in one write (one ASGI send):
    # at GPU rates a response writes per batch of events, not per event. Token events that
    # arrived together are rendered as one, for a renderer that takes them so.
    pending: list[bytes] = []
    run: list[Indexed] = []
    try:
        async for item, more in each():
            observers.see(item.event, loop.time())
            await claim(item)
            if merging:
                if run and not joins(run[-1], item):
                    pending += await renderer.lines(merged(run))
                    run = []
                if mergeable(item):
                    run.append(item)
                    if more and len(run) < MAX_RUN:
                        continue
                    item, run = merged(run), []
            if isinstance(item.event, ErrorChunk):
                last_error = item.event
            finished = item.event if isinstance(item.event, TaskFinished) else None
            if finished and (failed := failure_of(finished, last_error)):
                observers.metrics.error(failed.code)
                if out := b"".join([*pending, *renderer.failed(failed)]):
                    yield out
                return
            pending += await renderer.lines(item)
            if pending and (len(pending) >= MAX_LINES_A_WRITE or not more):
                yield b"".join(pending)
                pending.clear()
        if run:  # a reader ends after a terminal, which no run holds: kept for safety
            pending += await renderer.lines(merged(run))
    except FleetError as exc:  # deadline, NATS gone: the headers are out, so say it in-band
        observers.metrics.error(exc.code)
        if run:
            pending += await renderer.lines(merged(run))
        if out := b"".join([*pending, *renderer.failed(exc)]):
            yield out
        return
    if out := b"".join([*pending, *renderer.closing()]):
        yield out


def claimer(backend: Backend, tenant: str | None) -> Claim:
    """Records each image a tenant's task produced as that tenant's (to serve it back)."""

    async def claim(item: Indexed) -> None:
        if tenant is not None and isinstance(item.event, ImageChunk):
            await backend.owners.own_image(item.event.sha256, tenant)

    return claim


async def run_task(
    backend: Backend,
    metrics: GatewayMetrics,
    tasks: Sequence[Task],
    renderer: Renderer,
    receive: Receive,
    *,
    stream: bool,
    resumable: bool,
    timeout_s: float,
    records: Mapping[str, TaskRecord],
    tenant: str | None = None,
    capacity: Capacity | None = None,
    settle: Settle | None = None,
    running: Callable[[], None] | None = None,
) -> Response:
    """One request: one task, or one per choice (their events merged). `records` (task id →
    TaskRecord) are written before anything is published.

    It holds a place in `capacity` (429 when there is none) until its response ends, and then
    calls `settle` with the tokens it served (fleet.gateway.fair_share charges them);
    `running` when a runner first accepts a task of it."""
    capacity = capacity or Capacity(2**31, 2**31)
    who = capacity.take(tenant)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            capacity.give_back(who)

    try:
        response = await _run_task(
            backend, metrics, tasks, renderer, receive, stream=stream, resumable=resumable,
            timeout_s=timeout_s, records=records, tenant=tenant, release=release,
            settle=settle or _no_settle, running=running,
        )
    except BaseException:
        release()
        if settle is not None:
            await settle(0)  # nothing published, or settled already (it runs once)
        raise
    if not isinstance(response, EventStream):
        release()
    return response


async def _run_task(
    backend: Backend,
    metrics: GatewayMetrics,
    tasks: Sequence[Task],
    renderer: Renderer,
    receive: Receive,
    *,
    stream: bool,
    resumable: bool,
    timeout_s: float,
    records: Mapping[str, TaskRecord],
    tenant: str | None,
    release: Callable[[], None],
    settle: Settle,
    running: Callable[[], None] | None = None,
) -> Response:
    loop = asyncio.get_running_loop()
    started = loop.time()
    observers = Observers(metrics, tasks[0], started)
    claim = claimer(backend, tenant)
    for task in tasks:
        backend.check_size(task)  # 413 before anything is published
    for task_id, record in records.items():  # one by one: a failure is the request's, whole
        await backend.owners.record_task(task_id, record)
    # Listening before publishing: nothing is stored for a fresh id, so no replay is needed,
    # and a NATS that is down fails the request before a task is queued for nobody.
    events = await _open_events(backend, tasks, deadline=started + timeout_s)
    if running is not None:
        events.when_running(running)
    published: list[str] = []
    handed_over = False
    try:
        for task in tasks:
            try:
                await backend.publish_task(task)
            except asyncio.CancelledError:
                published.append(task.task_id)  # perhaps stored: cancelled with the others
                raise
            published.append(task.task_id)
        if not stream:
            items = await unless_hung_up(receive, events.rest())
            if items is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            for item in items:
                observers.see(item.event, loop.time())
                await claim(item)
            if events.finished and (failed := failure_of(events.finished, _last_error(items))):
                raise failed
            return JSONResponse(await renderer.body([item.event for item in items]))
        head = await unless_hung_up(receive, events.until_committed())
        if head is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if events.finished and (failed := failure_of(events.finished, _last_error(head))):
            raise failed
        handed_over = True
    except FleetError as exc:
        if not published:
            raise
        # Answered, not raised: the tasks exist, so this answer names them like any other
        # (the caller adds the task id headers), for `fleet trace` and the task's events.
        return counted_error_response(metrics, exc)
    finally:
        if not handed_over:
            await events.close()
            for task_id in set(events.unfinished()) & set(published):
                await backend.cancel_quietly(task_id, "the request ended before the task")
            await settle(served_tokens(events.finished))

    async def on_close(hung_up: bool) -> None:
        release()
        await events.close()
        await settle(served_tokens(events.finished))
        if resumable and hung_up:
            return
        why = "the client disconnected" if hung_up else "the stream ended before the task"
        for task_id in events.unfinished():
            await backend.cancel_quietly(task_id, why)

    return EventStream(_relay(head, events, renderer, observers, claim), on_close)


Settle = Callable[[int], Awaitable[None]]


async def _no_settle(tokens: int) -> None:
    return None


def served_tokens(finished: TaskFinished | None) -> int:
    """What a request served, for fair sharing: its prompt and completion tokens."""
    usage = finished.usage if finished is not None else None
    return usage.prompt_tokens + usage.completion_tokens if usage is not None else 0


async def _open_events(backend: Backend, tasks: Sequence[Task], deadline: float) -> Events:
    if len(tasks) == 1:
        return await backend.events(tasks[0].task_id, deadline=deadline, replay=False)
    parts: list[TaskEvents] = []
    try:
        for task in tasks:
            parts.append(await backend.events(task.task_id, deadline=deadline, replay=False))
    except BaseException:
        for part in parts:
            await part.close()
        raise
    return ChoiceEvents(parts)


class Observers:
    """A TaskObserver per task, so each choice's timings are its own."""

    def __init__(self, metrics: GatewayMetrics, task: Task, started: float) -> None:
        """`task`: the request's first (its choices differ only in their ids)."""
        self.metrics = metrics
        self.task = task
        self.started = started
        self.by_task: dict[str, TaskObserver] = {}

    def see(self, event: OutputEvent, now: float) -> None:
        observer = self.by_task.get(event.task_id)
        if observer is None:
            observer = self.by_task[event.task_id] = TaskObserver(
                self.metrics, self.task, self.started
            )
        observer.see(event, now)


def _last_error(items: list[Indexed]) -> ErrorChunk | None:
    errors = [item.event for item in items if isinstance(item.event, ErrorChunk)]
    return errors[-1] if errors else None
