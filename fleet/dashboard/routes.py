"""Routes under /ui. The page and its static files are open (they hold no data: the page asks
for a key); everything under /ui/api goes through the gateway's ApiKeys middleware like /v1,
so the browser sends `Authorization: Bearer KEY` on every call, the feed included (it is read
with fetch, not EventSource, which cannot send headers). No cookie: nothing a third-party page
could make the browser send on the operator's behalf."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.aio import Supervisor
from fleet.dashboard import actions, task_routes
from fleet.dashboard.access import is_operator
from fleet.dashboard.feed import Feed
from fleet.gateway.surface import Endpoint, EventStream, Row, routes, tenant_of

STATIC = Path(__file__).parent / "static"


def feed_of(request: Request) -> Feed:
    return request.app.state.dashboard_feed


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})


async def whoami(request: Request) -> Response:
    """200 when the key is good (ApiKeys already refused a bad one with 401)."""
    return JSONResponse({"tenant": tenant_of(request), "operator": is_operator(request)})


async def feed(request: Request) -> Response:
    """The tab's SSE feed (fleet.gateway.sse: keep-alives while idle, a client that stops
    reading dropped after the send timeout)."""
    hub = feed_of(request)
    tab = hub.subscribe(tenant_of(request), is_operator(request))

    async def lines() -> AsyncIterator[bytes]:
        while tab in hub.tabs:
            yield await tab.queue.get()

    async def on_close(hung_up: bool) -> None:
        hub.unsubscribe(tab)

    return EventStream(lines(), on_close)


def _ui(method: str, path: str, handler: Endpoint) -> Row:
    """A /ui route: served, and left out of the gateway's OpenAPI document (the page's own
    API, not the fleet's)."""
    return Row(method, path, handler, public=False)


API_ROWS = (
    _ui("GET", "/ui/api/whoami", whoami),
    _ui("GET", "/ui/api/feed", feed),
    _ui("GET", "/ui/api/tasks/{task_id}/events", task_routes.events),
    _ui("GET", "/ui/api/tasks/{task_id}/trace", task_routes.trace),
    _ui("POST", "/ui/api/tasks/{task_id}/cancel", task_routes.cancel),
    _ui("GET", "/ui/api/images/{sha256}", task_routes.image),
    _ui("GET", "/ui/api/dead", actions.dead_letters),
    _ui("POST", "/ui/api/instances", actions.place_instance),
    _ui("DELETE", "/ui/api/instances/{instance_id}", actions.remove_instance),
)
# Served by OpenPages, before the key check.
PAGE_ROWS = (
    _ui("GET", "/ui", index),
    _ui("GET", "/ui/", index),
    Row("GET", "/ui/static", static=STATIC, public=False),
)


class OpenPages:
    """Serves /ui and /ui/static/* before the key check: they carry no data."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pages = Starlette(routes=routes(PAGE_ROWS))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path in ("/ui", "/ui/") or path.startswith("/ui/static/")):
            return await self.pages(scope, receive, send)
        await self.app(scope, receive, send)


def mount(app: Starlette) -> None:
    """Add the dashboard to the gateway's app: its routes, the open pages in front of the
    middleware stack, and its one feed, started and stopped with the app."""
    app.router.routes.extend(routes(API_ROWS))
    app.add_middleware(OpenPages)

    async def start_feed(app_: Starlette, owner: Supervisor) -> None:
        hub = Feed(gateway_of_app(app_).backend)
        app_.state.dashboard_feed = hub
        hub.start(owner)  # its loops: children of the gateway lifespan's Supervisor

    app.state.lifespan_children.append(start_feed)


def gateway_of_app(app: Starlette) -> Any:
    return app.state.gateway
