"""Routes under /ui. The page and its static files are open (they hold no data: the page asks
for a key); everything under /ui/api goes through the gateway's ApiKeys middleware like /v1,
so the browser sends `Authorization: Bearer KEY` on every call, the feed included (it is read
with fetch, not EventSource, which cannot send headers). No cookie: nothing a third-party page
could make the browser send on the operator's behalf."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.dashboard.feed import Feed
from fleet.errors import FleetError, ModelNotFound
from fleet.gateway.guards import tenant_of
from fleet.gateway.service import gateway_of
from fleet.models.catalog import get_card
from fleet.placement import place, remove
from fleet.trace.cli import linked_spans, spans_of_trace, trace_id_of_task
from fleet.trace.render import label, tree_rows
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task

STATIC = Path(__file__).parent / "static"
TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
KEEPALIVE_S = 15.0
DEAD_SHOWN = 50


def feed_of(request: Request) -> Feed:
    return request.app.state.dashboard_feed


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})


async def whoami(request: Request) -> Response:
    """200 when the key is good (ApiKeys already refused a bad one with 401)."""
    return JSONResponse({"tenant": tenant_of(request)})


async def feed(request: Request) -> Response:
    hub = feed_of(request)
    queue = hub.subscribe()

    async def lines() -> AsyncIterator[bytes]:
        try:
            while queue in hub.subscribers:
                try:
                    yield await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
        finally:
            hub.unsubscribe(queue)

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def trace(request: Request) -> Response:
    """The task's spans (and those of linked traces it overlapped), as `fleet trace` finds
    them; the page draws the waterfall."""
    task_id = request.path_params["task_id"]
    if not TASK_ID.match(task_id):
        return JSONResponse({"error": "bad task id"}, status_code=400)
    backend = gateway_of(request).backend
    if not await backend.owners.owns_task(task_id, tenant_of(request)):
        return JSONResponse({"error": "unknown task"}, status_code=404)
    try:
        js = backend.jetstream()
        trace_id = await trace_id_of_task(js, task_id)
        spans: list[Any] = await spans_of_trace(js, trace_id) if trace_id else []
        if spans:
            spans += await linked_spans(js, spans, min(s["start_ns"] for s in spans))
    except (NatsError, OSError, TimeoutError) as exc:
        return JSONResponse({"error": f"NATS: {exc!r}"}, status_code=503)
    rows = [{**row.span, "prefix": row.prefix, "label": label(row.span)}
            for row in tree_rows(spans)]
    return JSONResponse({"trace_id": trace_id, "spans": rows})


def readable_task_id(data: bytes) -> str | None:
    try:
        return decode_task(data).task_id
    except DecodeError as exc:
        return exc.task_id


async def dead_letters(request: Request) -> Response:
    """The newest dead letters (FLEET_DEAD), with the reason the janitor gave each. Under NATS
    roles the gateway may not read stored messages of FLEET_DEAD: then the error says so."""
    js = gateway_of(request).backend.jetstream()
    found: list[dict[str, Any]] = []
    try:
        info = await js.stream_info(subjects.DEAD_LETTERS_STREAM)
        seq = info.state.last_seq
        while seq >= max(1, info.state.first_seq) and len(found) < DEAD_SHOWN:
            with contextlib.suppress(NotFoundError):
                msg = await js.get_msg(subjects.DEAD_LETTERS_STREAM, seq)
                headers = msg.headers or {}
                found.append({
                    "seq": seq, "model": subjects.model_of_dead_letter(msg.subject or ""),
                    "task_id": readable_task_id(msg.data or b""),
                    "reason": headers.get("Fleet-Reason"),
                    "deliveries": headers.get("Fleet-Deliveries"),
                })
            seq -= 1
    except (NatsError, OSError, TimeoutError) as exc:
        return JSONResponse({"error": f"could not read FLEET_DEAD: {exc!r}"}, status_code=503)
    return JSONResponse({"dead_letters": found})


def _refused(exc: Exception, cli: str) -> Response:
    """The gateway's NATS role may not write FLEET_INSTANCES (fleet/bus/roles.py): under
    roles the action is refused, and the page shows the operator's command instead."""
    return JSONResponse({"error": f"the gateway could not do this: {exc}", "cli": cli},
                        status_code=403)


async def remove_instance(request: Request) -> Response:
    instance_id = request.path_params["instance_id"]
    cli = f"fleet instances remove {instance_id}"
    try:
        await remove(gateway_of(request).backend.jetstream(), instance_id)
    except (FleetError, NatsError, OSError, TimeoutError) as exc:
        return _refused(exc, cli)
    return JSONResponse({"removed": instance_id})


async def place_instance(request: Request) -> Response:
    body = await request.json()
    model, node = str(body.get("model", "")), body.get("node") or None
    cli = f"fleet instances place --model {model}" + (f" --node {node}" if node else "")
    gateway = gateway_of(request)
    try:
        card = get_card(model, gateway.settings.data_dir)
    except (ModelNotFound, FleetError) as exc:
        return JSONResponse({"error": str(exc)}, status_code=404)
    try:
        instance = await place(gateway.backend.jetstream(), card, node_id=node)
    except (FleetError, NatsError, OSError, TimeoutError) as exc:
        return _refused(exc, cli)
    return JSONResponse({"placed": instance.instance_id, "node": instance.shards[0].node_id})


API_ROUTES = [
    Route("/ui/api/whoami", whoami, methods=["GET"]),
    Route("/ui/api/feed", feed, methods=["GET"]),
    Route("/ui/api/tasks/{task_id}/trace", trace, methods=["GET"]),
    Route("/ui/api/dead", dead_letters, methods=["GET"]),
    Route("/ui/api/instances", place_instance, methods=["POST"]),
    Route("/ui/api/instances/{instance_id}", remove_instance, methods=["DELETE"]),
]


class OpenPages:
    """Serves /ui and /ui/static/* before the key check: they carry no data."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pages = Starlette(routes=[
            Route("/ui", index), Route("/ui/", index),
            Mount("/ui/static", app=StaticFiles(directory=STATIC)),
        ])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path in ("/ui", "/ui/") or path.startswith("/ui/static/")):
            return await self.pages(scope, receive, send)
        await self.app(scope, receive, send)


def mount(app: Starlette) -> None:
    """Add the dashboard to the gateway's app: its routes, the open pages in front of the
    middleware stack, and its one feed, started and stopped with the app."""
    app.router.routes.extend(API_ROUTES)
    app.add_middleware(OpenPages)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Starlette) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            hub = Feed(gateway_of_app(app_).backend)
            app_.state.dashboard_feed = hub
            await hub.start()
            try:
                yield state
            finally:
                await hub.close()

    app.router.lifespan_context = lifespan


def gateway_of_app(app: Starlette) -> Any:
    return app.state.gateway
