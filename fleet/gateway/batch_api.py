"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel. The job itself runs in whichever gateway holds its lease
(fleet.gateway.batch_runner); these routes only read and write its record, so any gateway
answers for any job. A job is the tenant's: another tenant's reads as missing."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import HttpError, InvalidParameter
from fleet.gateway.auth import tenant_of
from fleet.gateway.batch_lines import WINDOW_S, openai_batch
from fleet.gateway.batch_runner import BatchRunner
from fleet.gateway.bodies import OpenAIRequest, parse, read_json
from fleet.gateway.files_api import owned_file
from fleet.gateway.idempotency import new_id
from fleet.wire.batches import FINAL_STATUSES, BatchEndpoint, BatchRecord
from fleet.wire.tasks import is_task_id


class CreateBatch(OpenAIRequest):
    input_file_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    endpoint: BatchEndpoint
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def page_limit(asked: str | None) -> int:
    """OpenAI's `limit`: 1-100, 20 when not given."""
    if asked is None:
        return 20
    if not asked.isdigit() or not 1 <= int(asked) <= 100:
        raise InvalidParameter("limit: a whole number from 1 to 100", "limit")
    return int(asked)


def runner_of(request: Request) -> BatchRunner:
    return request.app.state.batches


def missing(batch_id: str) -> HttpError:
    return HttpError(404, f"no batch {batch_id} is known here")


async def owned_batch(request: Request, batch_id: str) -> tuple[BatchRecord, int]:
    if not is_task_id(batch_id):  # not a key of FLEET_BATCHES: nothing can be stored there
        raise missing(batch_id)
    found = await runner_of(request).store.batch(batch_id)
    tenant = tenant_of(request)
    if found is None or (tenant is not None and found[0].tenant != tenant):
        raise missing(batch_id)
    return found


async def create_batch(request: Request) -> Response:
    asked = parse(CreateBatch, await read_json(request))
    source = await owned_file(request, asked.input_file_id)
    if source.purpose != "batch":
        raise InvalidParameter("input_file_id: not a file uploaded with purpose batch",
                               "input_file_id")
    now = int(time.time())
    record = BatchRecord(
        id=new_id("batch"), tenant=tenant_of(request), endpoint=asked.endpoint,
        input_file_id=source.id, completion_window=asked.completion_window, created_at=now,
        expires_at=now + WINDOW_S[asked.completion_window], metadata=asked.metadata,
    )
    runner = runner_of(request)
    if await runner.store.create_batch(record):
        # The lease first, held here: this gateway starts the job now, not at its next scan.
        if (revision := await runner.store.create_lease(runner.lease_for(record.id))) is not None:
            runner.start_job(record.id, revision)
    else:  # the same id again (an idempotent retry): answer with what is recorded
        record, _ = await owned_batch(request, record.id)
    return JSONResponse(openai_batch(record))


async def get_batch(request: Request) -> Response:
    record, _ = await owned_batch(request, request.path_params["batch_id"])
    return JSONResponse(openai_batch(record))


async def list_batches(request: Request) -> Response:
    tenant = tenant_of(request)
    limit = page_limit(request.query_params.get("limit"))
    after = request.query_params.get("after")
    records = sorted(
        (r for r in await runner_of(request).store.batches()
         if tenant is None or r.tenant == tenant),
        key=lambda r: (r.created_at, r.id), reverse=True,
    )
    if after is not None:
        ids = [r.id for r in records]
        records = records[ids.index(after) + 1:] if after in ids else []
    page = records[:limit]
    return JSONResponse({
        "object": "list", "data": [openai_batch(r) for r in page],
        "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
        "has_more": len(records) > limit,
    })


async def cancel_batch(request: Request) -> Response:
    """Cancelling at once; the runner stops feeding, cancels what runs, then `cancelled`."""
    batch_id = request.path_params["batch_id"]
    store = runner_of(request).store
    while True:
        record, revision = await owned_batch(request, batch_id)
        if record.status in FINAL_STATUSES or record.status == "cancelling":
            return JSONResponse(openai_batch(record))
        cancelling = record.model_copy(update={"status": "cancelling",
                                               "cancelling_at": int(time.time())})
        if await store.update_batch(cancelling, revision) is not None:
            return JSONResponse(openai_batch(cancelling))
