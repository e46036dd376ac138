"""GET /v1/tasks/{id}/events: a task's raw Fleet events, resumable by index.

Only the tenant that made a task may read it (another tenant gets the same 404 as an unknown
id); the stream holds a place in the gateway's capacity (429 when full) and ends after its
idle time with an in-band `error` event whose code is `idle`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response

from fleet.errors import FleetError
from fleet.gateway.backend import Backend
from fleet.gateway.flow import EventStream, claimer
from fleet.gateway.guards import HttpError
from fleet.gateway.limits import Capacity
from fleet.gateway.replies import sse_error
from fleet.gateway.streams import Indexed


def not_found(task_id: str) -> HttpError:
    # The same words for another tenant's task and a missing one: nothing confirms an id.
    return HttpError(404, f"no events are stored for task {task_id}: unknown or expired")


async def resume(
    backend: Backend,
    task_id: str,
    after: int,
    timeout_s: float,
    *,
    idle_s: float | None = None,
    tenant: str | None = None,
    capacity: Capacity | None = None,
) -> Response:
    """A task's raw Fleet events after the first `after`, as SSE with `id:` = event index.

    The stream opens at once, since a queued task has no events yet; running out of time, or
    `idle_s` without an event, is an in-band error event. A client that has seen events of a
    task no longer stored gets 404, and so does another tenant's task.
    """
    if not await backend.owners.owns_task(task_id, tenant):
        raise not_found(task_id)
    if after > 0 and await backend.stored_events(task_id) == 0:
        raise not_found(task_id)
    capacity = capacity or Capacity(2**31, 2**31)
    who = capacity.take(tenant)
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        events = await backend.events(task_id, deadline=deadline, after=after, idle_s=idle_s)
    except BaseException:
        capacity.give_back(who)
        raise
    claim = claimer(backend, tenant)

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for item in events:
                await claim(item)
                yield _raw_sse(item)
        except FleetError as exc:
            yield sse_error(exc)

    async def on_close(hung_up: bool) -> None:
        capacity.give_back(who)
        await events.close()  # a reader leaving never cancels: others may still be reading

    return EventStream(lines(), on_close)


def _raw_sse(item: Indexed) -> bytes:
    head = f"event: {item.event.type}\nid: {item.index}\ndata: ".encode()
    return head + item.raw + b"\n\n"
