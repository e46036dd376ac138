"""The operator's actions on the dashboard: place an instance on a node, remove one, and the
dead letters list. Operator keys only: the gateway's NATS role may write FLEET_INSTANCES and
read FLEET_DEAD's stored messages (fleet/bus/roles.py), so the check that a tenant key may
not is this one, made before any NATS call."""

from __future__ import annotations

from nats.errors import Error as NatsError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.dashboard.access import is_operator, operators_only
from fleet.errors import FleetError
from fleet.gateway.surface import gateway_of
from fleet.models.catalog import get_card
from fleet.placement import place, remove
from fleet.placement_replicas import place_replicas
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task

DEAD_SHOWN = 50


def readable_task_id(data: bytes) -> str | None:
    try:
        return decode_task(data).task_id
    except DecodeError as exc:
        return exc.task_id


async def dead_letters(request: Request) -> Response:
    """The newest dead letters (FLEET_DEAD), with the reason the janitor gave each; to
    operators only, as they are every tenant's. Read through the task queue
    (fleet.bus.task_queue), within the gateway's read budget."""
    if not is_operator(request):
        return operators_only()
    try:
        letters = await gateway_of(request).backend.task_queue().newest_dead(DEAD_SHOWN)
    except FleetError as exc:  # not connected, or the reads ran past their budget
        return JSONResponse({"error": f"could not read FLEET_DEAD: {exc.message}"},
                            status_code=exc.http_status)
    except (NatsError, OSError, TimeoutError) as exc:
        return JSONResponse({"error": f"could not read FLEET_DEAD: {exc!r}"}, status_code=503)
    found = [{
        "seq": msg.seq, "model": subjects.model_of_dead_letter(msg.subject or ""),
        "task_id": readable_task_id(msg.data or b""),
        "reason": (msg.headers or {}).get("Fleet-Reason"),
        "deliveries": (msg.headers or {}).get("Fleet-Deliveries"),
    } for msg in letters]
    return JSONResponse({"dead_letters": found})


def _refused(exc: Exception, cli: str) -> Response:
    """NATS refused or failed the write (the gateway's role may write FLEET_INSTANCES, but a
    server with an older auth.conf may not let it): the page shows the CLI command instead."""
    return JSONResponse({"error": f"the gateway could not do this: {exc}", "cli": cli},
                        status_code=503)


async def remove_instance(request: Request) -> Response:
    if not is_operator(request):
        return operators_only()
    instance_id = request.path_params["instance_id"]
    cli = f"fleet instances remove {instance_id}"
    backend = gateway_of(request).backend
    try:
        if not any(i.instance_id == instance_id for i in await backend.instances()):
            return JSONResponse({"error": f"no instance {instance_id} is placed (removed "
                                 "already, or never placed)"}, status_code=404)
        await remove(backend.jetstream(), instance_id)
    except FleetError as exc:
        return JSONResponse({"error": str(exc), "cli": cli}, status_code=exc.http_status)
    except (NatsError, OSError, TimeoutError) as exc:
        return _refused(exc, cli)
    return JSONResponse({"removed": instance_id})


async def place_instance(request: Request) -> Response:
    if not is_operator(request):
        return operators_only()
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"error": "the body is not JSON"}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    model, node = str(body.get("model", "")), body.get("node") or None
    shards, replicas = body.get("shards", 1), body.get("replicas", 1)
    if why := count_refusal(shards, replicas):
        return JSONResponse({"error": why}, status_code=400)
    cli = (f"fleet instances place --model {model}" + (f" --node {node}" if node else "")
           + (f" --shards {shards}" if shards > 1 else "")
           + (f" --replicas {replicas}" if replicas > 1 else ""))
    gateway = gateway_of(request)
    try:
        card = get_card(model, gateway.settings.data_dir)
    except FleetError as exc:
        return JSONResponse({"error": str(exc)}, status_code=404)
    js = gateway.backend.jetstream()
    try:
        if replicas > 1:
            placed = await place_replicas(js, card, replicas, node_id=node)
        else:
            placed = [await place(js, card, node_id=node, shards=shards)]
    except FleetError as exc:  # no node can hold it, the node is not alive, ...
        return JSONResponse({"error": str(exc), "cli": cli}, status_code=exc.http_status)
    except (NatsError, OSError, TimeoutError) as exc:
        return _refused(exc, cli)
    first = placed[0]
    return JSONResponse({"placed": first.instance_id, "node": first.shards[0].node_id,
                         "instances": [i.instance_id for i in placed],
                         "nodes": sorted({s.node_id for i in placed for s in i.shards})})


MAX_SPLIT = 8  # shards or replicas one form may ask for


def count_refusal(shards: object, replicas: object) -> str | None:
    """Why the form's shards and replicas cannot be placed, or None. Pure."""
    for name, value in (("shards", shards), ("replicas", replicas)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SPLIT:
            return f"{name}: a whole number from 1 to {MAX_SPLIT}"
    if shards != 1 and replicas != 1:
        return "shards and replicas do not combine (yet): one instance split, or copies"
    return None
