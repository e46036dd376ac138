"""The routes around the APIs: tasks (cancel, resume), models, health and metrics (the
OpenAPI document is served by fleet/gateway/api_table.py, from the route table)."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import FleetError, InvalidParameter, ModelNotFound
from fleet.gateway.auth import authenticated, tenant_of
from fleet.gateway.catalogue import model_list, model_object
from fleet.gateway.resume import known_record, resume
from fleet.gateway.service import gateway_of, image_url_for
from fleet.meters import PROMETHEUS_TEXT

TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


COUNT = re.compile(r"^[0-9]{1,9}$")


def _task_id(request: Request) -> str:
    task_id = request.path_params["task_id"]
    if not TASK_ID.match(task_id):
        raise InvalidParameter("a task id has 1 to 128 letters, digits, '-' or '_'", "task_id")
    return task_id


async def cancel_task(request: Request) -> Response:
    """Cancel a task of the caller's tenant, or every choice of an n > 1 request; an unknown
    id, or another tenant's, is 404."""
    task_id = _task_id(request)
    backend = gateway_of(request).backend
    record = await known_record(backend, task_id, tenant_of(request))
    cancelled = record.choices if record is not None and record.choices else [task_id]
    for each in cancelled:
        await backend.cancel(each, "cancelled through the gateway")
    return JSONResponse({"id": task_id, "object": "task.cancel", "cancelled": True,
                         "task_ids": cancelled})


def _events_seen(request: Request) -> int:
    after = request.query_params.get("after", "0")
    if not COUNT.match(after):
        raise InvalidParameter("after: the number of events already seen, 0 or more", "after")
    # EventSource clients reconnect with the last `id:` they saw in this header.
    last_id = request.headers.get("last-event-id", "")
    return max(int(after), int(last_id) if COUNT.match(last_id) else 0)


def _native(request: Request) -> bool:
    wanted = request.query_params.get("format", "openai")
    if wanted not in ("openai", "native"):
        raise InvalidParameter("format: openai (the request's own format) or native (Fleet's "
                               "events)", "format")
    return wanted == "native"


async def task_events(request: Request) -> Response:
    task_id = _task_id(request)
    seen = _events_seen(request)
    gateway = gateway_of(request)
    settings = gateway.settings
    return await resume(
        gateway.backend, task_id, seen, settings.gateway_timeout_s,
        idle_s=settings.gateway_events_idle_s, tenant=tenant_of(request),
        capacity=gateway.capacity, native=_native(request), url_of=image_url_for(request),
    )


async def list_models(request: Request) -> Response:
    """The models a client can use now; `?all=true`: the whole catalogue."""
    everything = request.query_params.get("all", "false")
    if everything not in ("true", "false"):
        raise InvalidParameter("all: true (every model card, usable or not) or false", "all")
    gateway = gateway_of(request)
    states = await gateway.model_states()
    return JSONResponse(model_list(gateway.cards(), states, gateway.availability(),
                                   everything=everything == "true"))


async def get_model(request: Request) -> Response:
    gateway = gateway_of(request)
    model = request.path_params["model"]
    card = gateway.catalogue.card(model)
    if card is None:
        raise ModelNotFound(f"the model {model!r} does not exist")
    states = await gateway.model_states()
    return JSONResponse(model_object(
        card, states.get(model) if states else None, unavailable=gateway.availability()
    ))


async def healthz(request: Request) -> Response:
    """Without a key only {"status": ...}: whether the gateway can serve. With a key (or on a
    gateway without keys) also NATS (its URL without password), streams and models."""
    healthy, report = await gateway_of(request).health()
    status = {"status": "ok" if healthy else "unavailable"}
    body = {**report, **status} if authenticated(request) else status
    return JSONResponse(body, status_code=200 if healthy else 503)


async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    try:
        queues = await gateway.backend.queue_stats()
    except FleetError:
        queues = {}  # the scrape still reports what the gateway itself saw
    return Response(
        gateway.metrics.render(queues, gateway.capacity.waiting), media_type=PROMETHEUS_TEXT
    )
