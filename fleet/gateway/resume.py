"""GET /v1/tasks/{id}/events: a task's events, resumable by index, in the format of the
request that made it (chat.completion.chunk, text_completion, the Responses events, image
events), or as raw Fleet events with `?format=native` (and always for a task published
straight on NATS, which no request shaped).

The format comes from the task's TaskRecord (fleet/gateway/owners.py), which every gateway
writes before publishing, so any gateway can resume any task. An id with neither a record nor
stored events is unknown: 404, and so is another tenant's task (the same words: nothing
confirms an id). The stream holds a place in the gateway's capacity (429 when full) and ends
after its idle time with an in-band `error` whose code is `idle`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

from fleet.bus.task_events import Indexed
from fleet.errors import FleetError, InvalidParameter, failure_of
from fleet.gateway.backend import Backend
from fleet.gateway.capacity import Capacity
from fleet.gateway.errors import not_found
from fleet.gateway.image_api import ImageRenderer
from fleet.gateway.relay import Renderer, claimer
from fleet.gateway.responses_api import ResponseShape, ResponsesRenderer
from fleet.gateway.sse import EventStream, sse_error
from fleet.gateway.text_replies import ChatRenderer, CompletionRenderer, Reply
from fleet.wire.events import ErrorChunk, TaskFinished
from fleet.wire.records import TaskRecord


async def stored_count(backend: Backend, task_id: str) -> int:
    """How many events FLEET_OUT holds for the task, through the task log (fleet.bus.task_log),
    retried within the gateway's read budget; NatsUnavailable (503) after it."""
    return await backend.stored_events(task_id)


async def known_record(backend: Backend, task_id: str, tenant: str | None) -> TaskRecord | None:
    """The task's record (None for a task published on NATS), or 404 when the caller may not
    see it: another tenant's, or an id with neither a record nor stored events."""
    record = await backend.owners.task_record(task_id)
    if tenant is not None and (record is None or record.tenant != tenant):
        raise not_found(task_id)
    if record is None and await stored_count(backend, task_id) == 0:
        raise not_found(task_id)
    return record


def renderer_for(
    record: TaskRecord, task_id: str, backend: Backend, url_of: Callable[[str], str]
) -> Renderer:
    """The renderer of the request that made the task, as far as its record tells."""
    reply = Reply(task_id, record.model, record.created, record.logprobs, record.include_usage,
                  echo=() if record.echo is None else (record.echo,))
    match record.api:
        case "chat.completions":
            return ChatRenderer(reply)
        case "completions":
            return CompletionRenderer(reply)
        case "responses":
            return ResponsesRenderer(ResponseShape(task_id, record.model, record.created))
        case "images.generations":
            return ImageRenderer(backend, "image_generation", record.created, False, url_of)
        case "images.edits":
            return ImageRenderer(backend, "image_edit", record.created, False, url_of)


async def resume(
    backend: Backend,
    task_id: str,
    after: int,
    timeout_s: float,
    *,
    idle_s: float | None = None,
    tenant: str | None = None,
    capacity: Capacity | None = None,
    native: bool = True,
    url_of: Callable[[str], str] = lambda sha256: f"/v1/images/{sha256}",
) -> Response:
    """A task's events after the first `after`, as SSE with `id:` = event index: raw Fleet
    events when `native` (or the task has no record), else in its request's format.

    The stream opens at once, since a queued task has no events yet; running out of time, or
    `idle_s` without an event, is an in-band error event. A client that has seen events of a
    task no longer stored gets 404, and so does another tenant's task.
    """
    record = await known_record(backend, task_id, tenant)
    if record is not None and record.choices:
        raise InvalidParameter(
            f"task_id: {task_id} is a request with {len(record.choices)} choices, each a task "
            f"of its own: resume each of {', '.join(record.choices)}", "task_id",
        )
    if after > 0 and await stored_count(backend, task_id) == 0:
        raise not_found(task_id)
    renderer = None if native or record is None else renderer_for(
        record, task_id, backend, url_of)
    capacity = capacity or Capacity(2**31, 2**31)
    who = capacity.take(tenant)
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        # A rendered stream reads from the first event: the events already seen still shape
        # what follows (text so far, sequence numbers), only their lines are not sent again.
        events = await backend.events(task_id, deadline=deadline,
                                      after=after if renderer is None else 0, idle_s=idle_s)
    except BaseException:
        capacity.give_back(who)
        raise
    claim = claimer(backend, tenant)

    async def raw() -> AsyncIterator[bytes]:
        try:
            async for item in events:
                await claim(item)
                yield _raw_sse(item)
        except FleetError as exc:
            yield sse_error(exc)

    async def rendered(renderer: Renderer) -> AsyncIterator[bytes]:
        # The opening lines precede the task's first event: a client that saw any has them.
        opening = renderer.opening()
        for line in opening if after == 0 else []:
            yield line
        last_error: ErrorChunk | None = None
        try:
            async for item in events:
                seen = item.index <= after  # it only moves the renderer on
                if isinstance(item.event, ErrorChunk):
                    last_error = item.event
                if isinstance(item.event, TaskFinished) and (
                        failed := failure_of(item.event, last_error)):
                    for line in [] if seen else renderer.failed(failed):
                        yield line
                    return
                lines = await renderer.lines(item)
                if seen:
                    continue
                await claim(item)
                for line in lines:
                    yield line
        except FleetError as exc:
            for line in renderer.failed(exc):
                yield line
            return
        for line in renderer.closing():
            yield line

    async def on_close(hung_up: bool) -> None:
        capacity.give_back(who)
        await events.close()  # a reader leaving never cancels: others may still be reading

    return EventStream(raw() if renderer is None else rendered(renderer), on_close)


def _raw_sse(item: Indexed) -> bytes:
    head = f"event: {item.event.type}\nid: {item.index}\ndata: ".encode()
    return head + item.raw + b"\n\n"
