"""One task seen from the dashboard: its live events, its trace, its cancel, its images. The
task's tenant may reach them, and an operator for any task; to anyone else a task (or an
image) reads as unknown (404), as on /v1."""

from __future__ import annotations

import re
from typing import Any

from nats.errors import Error as NatsError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.dashboard.access import viewer_tenant
from fleet.errors import NatsUnavailable
from fleet.gateway.surface import gateway_of, image_format, resume
from fleet.trace.lookup import linked_spans, spans_of_trace, trace_id_of_task
from fleet.trace.render import label, tree_rows

TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _task_id(request: Request) -> str | None:
    task_id = request.path_params["task_id"]
    return task_id if TASK_ID.match(task_id) else None


def _unknown() -> Response:
    return JSONResponse({"error": "unknown task"}, status_code=404)


async def _readable(request: Request) -> str | None:
    """The task id when this caller may read that task."""
    task_id = _task_id(request)
    owners = gateway_of(request).backend.owners
    if task_id is None or not await owners.owns_task(task_id, viewer_tenant(request)):
        return None
    return task_id


async def events(request: Request) -> Response:
    """The task's Fleet events from the first, live (the same stream as /v1/tasks/{id}/events,
    opened to operators for every task)."""
    if (task_id := await _readable(request)) is None:
        return _unknown()
    gateway = gateway_of(request)
    settings = gateway.settings
    return await resume(
        gateway.backend, task_id, 0, settings.gateway_timeout_s,
        idle_s=settings.gateway_events_idle_s, tenant=viewer_tenant(request),
        capacity=gateway.capacity,
    )


async def cancel(request: Request) -> Response:
    if (task_id := await _readable(request)) is None:
        return _unknown()
    await gateway_of(request).backend.cancel(task_id, "cancelled from the dashboard")
    return JSONResponse({"id": task_id, "cancelled": True})


async def trace(request: Request) -> Response:
    """The task's spans (and those of linked traces it overlapped), as `fleet trace` finds
    them; the page draws the waterfall."""
    if (task_id := await _readable(request)) is None:
        return _unknown()
    backend = gateway_of(request).backend
    try:
        js = backend.jetstream()
        trace_id = await trace_id_of_task(backend.task_log(), task_id)
        spans: list[Any] = await spans_of_trace(js, trace_id) if trace_id else []
        if spans:
            spans += await linked_spans(js, spans, min(s["start_ns"] for s in spans))
    except NatsUnavailable as exc:  # the task log's reads, past their budget
        return JSONResponse({"error": f"NATS: {exc.message}"}, status_code=503)
    except (NatsError, OSError, TimeoutError) as exc:
        return JSONResponse({"error": f"NATS: {exc!r}"}, status_code=503)
    rows = [{**row.span, "prefix": row.prefix, "label": label(row.span)}
            for row in tree_rows(spans)]
    return JSONResponse({"trace_id": trace_id, "spans": rows})


async def image(request: Request) -> Response:
    """An image by its hash, to a tenant that owns it or to an operator (the backend refuses
    bytes that do not hash to the name)."""
    sha256 = request.path_params["sha256"]
    backend = gateway_of(request).backend
    if not SHA256.match(sha256) or not await backend.owners.owns_image(
            sha256, viewer_tenant(request)):
        return JSONResponse({"error": "unknown image"}, status_code=404)
    data = await backend.get_image(sha256)
    if data is None:
        return JSONResponse({"error": "unknown image"}, status_code=404)
    kind = image_format(data)
    return Response(data, media_type=f"image/{kind}" if kind else "application/octet-stream",
                    headers={"cache-control": "private, max-age=86400"})
