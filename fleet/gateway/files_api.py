"""OpenAI's Files API for batch jobs: POST /v1/files (multipart: `file`, `purpose=batch`),
GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}.

Files are the tenant's: another tenant's file reads as missing (404, the same words)."""

from __future__ import annotations

import time
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.bus.batch_store import BatchStore
from fleet.errors import HttpError, InvalidParameter
from fleet.gateway.auth import tenant_of
from fleet.gateway.idempotency import new_id
from fleet.gateway.service import gateway_of
from fleet.wire.batches import FileRecord
from fleet.wire.tasks import is_task_id


def store_of(request: Request) -> BatchStore:
    return request.app.state.batches.store


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id, "object": "file", "bytes": record.bytes,
        "created_at": record.created_at, "filename": record.filename, "purpose": record.purpose,
        "status": "processed", "expires_at": None, "status_details": None,
    }


def missing(file_id: str) -> HttpError:
    return HttpError(404, f"no file {file_id} is known here")


async def owned_file(request: Request, file_id: str) -> FileRecord:
    if not is_task_id(file_id):  # not a key of FLEET_BATCHES: nothing can be stored there
        raise missing(file_id)
    record = await store_of(request).file(file_id)
    tenant = tenant_of(request)
    if record is None or (tenant is not None and record.tenant != tenant):
        raise missing(file_id)
    return record


async def upload_file(request: Request) -> Response:
    limit = gateway_of(request).settings.gateway_max_body_bytes
    async with request.form(max_files=1, max_part_size=limit) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose != "batch":
            raise InvalidParameter("purpose: only `batch` files are taken here", "purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidParameter("file: upload the JSONL file as `file`", "file")
        data = await upload.read()
        filename = upload.filename or "input.jsonl"
    record = FileRecord(id=new_id("file"), tenant=tenant_of(request), filename=filename,
                        purpose="batch", bytes=len(data), created_at=int(time.time()))
    await store_of(request).put_file(record, data)
    return JSONResponse(file_object(record))


async def list_files(request: Request) -> Response:
    tenant = tenant_of(request)
    purpose = request.query_params.get("purpose")
    records = sorted(
        (r for r in await store_of(request).files()
         if (tenant is None or r.tenant == tenant) and (purpose is None or r.purpose == purpose)),
        key=lambda r: (r.created_at, r.id), reverse=True,
    )
    return JSONResponse({"object": "list", "data": [file_object(r) for r in records],
                         "has_more": False})


async def get_file(request: Request) -> Response:
    return JSONResponse(file_object(await owned_file(request, request.path_params["file_id"])))


async def file_content(request: Request) -> Response:
    record = await owned_file(request, request.path_params["file_id"])
    data = await store_of(request).file_bytes(record.id)
    return Response(data, media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    record = await owned_file(request, request.path_params["file_id"])
    await store_of(request).delete_file(record.id)
    return JSONResponse({"id": record.id, "object": "file", "deleted": True})
