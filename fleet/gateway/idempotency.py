"""`Idempotency-Key` on POST: a retry within 24 h attaches to what the first request made
and returns the same id; it never makes a second task or job, whichever gateway replica it
reaches.

The first request with a key creates `<tenant>.<sha256(key)>` in KV FLEET_IDEMPOTENCY
(create-if-absent: exactly one request wins, across replicas) holding a random seed; every id
the request makes derives from that seed (`new_id`, and fleet.gateway.service.new_task_id), so
a retry knows the ids without waiting for the first request's answer. A retry then:

- for a task (chat, completions, responses, images): attaches to the task, once its
  TaskRecord (written before it is published) is there: a stream replays the task's events
  in the request's format, a plain request waits for its end and gets the same body;
- for a file or a batch: runs the route again under the same seed, which finds what the
  first made (same id) and answers with it;
- with another body (or path) under the same key: 409, nothing is run.

A task whose record never appears (the first gateway died before publishing) is made by the
retry under the same id; the broker's Nats-Msg-Id and the worker's FLEET_CLAIMS claim keep
even a racing publish to one run. NATS publishers get the same by reusing a task id.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.bus.batch_store import IDEMPOTENCY_BUCKET, BatchStore
from fleet.bus.kv_calls import kv_create, kv_get
from fleet.errors import HttpError, failure_of
from fleet.gateway.auth import tenant_of
from fleet.gateway.errors import error_response
from fleet.gateway.idempotency_seed import SEED
from fleet.gateway.resume import renderer_for, resume
from fleet.gateway.service import TASK_ID_HEADER, gateway_of, image_url_for
from fleet.wire.batches import IdempotencyRecord
from fleet.wire.codec import decode_model, encode
from fleet.wire.events import ErrorChunk

HEADER = "idempotency-key"
REPLAY_HEADER = "x-fleet-idempotent-replay"
# The task id prefix each task route uses (fleet.gateway.text_api, image_api); a test checks
# them against the ids the routes make.
TASK_PREFIXES = {
    "/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl", "/v1/responses": "resp",
    "/v1/images/generations": "img", "/v1/images/edits": "img",
}
RECORD_WAIT_S = 5.0  # how long a retry waits for the first request's task record


Endpoint = Callable[[Request], Awaitable[Response]]


def seed() -> str | None:
    """The seed the ids of this request derive from (None: no Idempotency-Key)."""
    return SEED.get()


def new_id(prefix: str) -> str:
    """`batch_<…>` or `file-<…>`, as OpenAI spells them, from the request's seed if any."""
    joiner = "_" if prefix == "batch" else "-"
    return f"{prefix}{joiner}{seed() or secrets.token_urlsafe(18)}"


def record_key(tenant: str | None, key: str) -> str:
    return f"{tenant or '_'}.{hashlib.sha256(key.encode()).hexdigest()[:48]}"


def fingerprint(path: str, content_type: str, body: bytes) -> str:
    """What a retry must repeat: the path and the body (a multipart body by path alone: its
    boundary differs from one send to the next)."""
    part = b"" if content_type.startswith("multipart/") else body
    return hashlib.sha256(path.encode() + b"\0" + part).hexdigest()


def idempotent(endpoint: Endpoint) -> Endpoint:
    async def route(request: Request) -> Response:
        key = request.headers.get(HEADER)
        if not key:
            return await endpoint(request)
        if len(key) > 255:
            raise HttpError(400, "Idempotency-Key: at most 255 characters")
        body = await request.body()  # kept on the request: the endpoint reads it again
        wanted = IdempotencyRecord(
            path=request.url.path, seed=secrets.token_urlsafe(18), created_at=time.time(),
            fingerprint=fingerprint(request.url.path, request.headers.get("content-type", ""),
                                    body),
        )
        store: BatchStore = request.app.state.batches.store
        kv = await store.bucket(IDEMPOTENCY_BUCKET)
        name = record_key(tenant_of(request), key)
        if await kv_create(kv, name, encode(wanted)) is not None:
            return await _under(wanted.seed, endpoint, request)
        entry = await kv_get(kv, name)
        if entry is None or entry.value is None:  # expired in between: this one is first
            return await _under(wanted.seed, endpoint, request)
        first = decode_model(IdempotencyRecord, entry.value)
        if first.fingerprint != wanted.fingerprint:
            raise HttpError(409, "Idempotency-Key: this key was used with another request "
                            "(path or body); use a new key")
        prefix = TASK_PREFIXES.get(request.url.path)
        if prefix is None:
            return await _under(first.seed, endpoint, request)
        response = await _attach(request, f"{prefix}-{first.seed}", body)
        if response is None:  # the first never published: run it now, same ids
            return await _under(first.seed, endpoint, request)
        response.headers[REPLAY_HEADER] = "true"
        return response

    route.__name__ = getattr(endpoint, "__name__", "route")
    route.__doc__ = endpoint.__doc__
    return route


async def _under(value: str, endpoint: Endpoint, request: Request) -> Response:
    token = SEED.set(value)
    try:
        return await endpoint(request)
    finally:
        SEED.reset(token)


async def _attach(request: Request, task_id: str, body: bytes) -> Response | None:
    """The first request's task answered again, or None when it was never published."""
    gateway = gateway_of(request)
    backend = gateway.backend
    deadline = time.monotonic() + RECORD_WAIT_S
    while (record := await backend.owners.task_record(task_id)) is None:
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.1)  # the first request writes it within milliseconds
    if record.choices:
        raise HttpError(409, f"Idempotency-Key: the first request made {len(record.choices)} "
                        f"choices, each a task of its own: read {', '.join(record.choices)} "
                        "from /v1/tasks/<id>/events")
    try:
        asked = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError:
        asked = {}
    timeout_s = gateway.timeout_for(asked.get("timeout") if isinstance(asked, dict) else None)
    headers = {TASK_ID_HEADER: task_id}
    if isinstance(asked, dict) and asked.get("stream"):
        response = await resume(backend, task_id, 0, timeout_s, tenant=tenant_of(request),
                                capacity=gateway.capacity, native=False,
                                url_of=image_url_for(request))
        response.headers.update(headers)
        return response
    loop = asyncio.get_running_loop()
    events = await backend.events(task_id, deadline=loop.time() + timeout_s, replay=True)
    try:
        items = await events.rest()
    finally:
        await events.close()
    errors = [i.event for i in items if isinstance(i.event, ErrorChunk)]
    if events.finished and (failed := failure_of(events.finished, errors[-1] if errors else None)):
        answer: Response = error_response(failed)
    else:
        renderer = renderer_for(record, task_id, backend, image_url_for(request))
        answer = JSONResponse(await renderer.body([i.event for i in items]))
    answer.headers.update(headers)
    return answer

