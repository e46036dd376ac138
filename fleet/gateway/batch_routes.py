"""The rows of /v1/files and /v1/batches in the gateway's route table (fleet.gateway.api_table),
and the runner of batch jobs an app owns."""

from __future__ import annotations

from typing import Any

from fleet.bus.batch_store import BatchStore
from fleet.gateway import batch_api, files_api
from fleet.gateway.batch_api import CreateBatch
from fleet.gateway.batch_job import Policies
from fleet.gateway.batch_runner import BatchRunner
from fleet.gateway.idempotency import idempotent
from fleet.gateway.priority import OPEN
from fleet.gateway.route_table import ID_PATTERN, Body, Endpoint, Errors, Param, Row
from fleet.gateway.service import Gateway

BATCH_ERRORS = Errors(described={
    "400": "Bad request", "401": "Missing or wrong API key", "404": "Unknown id",
    "409": "Idempotency-Key reused with another request", "413": "Body too large",
    "503": "NATS unavailable",
})
_IDS = {"file_id": ID_PATTERN, "batch_id": ID_PATTERN}
_UPLOAD = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary"},
    "purpose": {"type": "string", "enum": ["batch"]}}}
_TAGS = ("Batches",)


def _row(method: str, path: str, handler: Endpoint, errors: tuple[str, ...],
         **fields: Any) -> Row:
    """Every batch route may answer 400 and 401 too."""
    return Row(method, path, handler, tags=_TAGS, error_shape=BATCH_ERRORS, patterns=_IDS,
               errors=("400", "401", *errors), **fields)


def batch_rows() -> tuple[Row, ...]:
    return (
        _row("POST", "/v1/files", files_api.upload_file, wrappers=(idempotent,),
             summary="Upload a JSONL file of batch requests (purpose `batch`)",
             operation_id="uploadFile", ok="The file object",
             body=Body(media_type="multipart/form-data", form=_UPLOAD),
             errors=("409", "413", "503")),
        _row("GET", "/v1/files", files_api.list_files, summary="This key's files",
             operation_id="listFiles", ok="A list of file objects",
             params=(Param("purpose", "query", {"type": "string"}),),
             errors=("503",)),
        _row("GET", "/v1/files/{file_id}", files_api.get_file, summary="A file object",
             operation_id="getFile", ok="The file",
             errors=("404", "503")),
        _row("DELETE", "/v1/files/{file_id}", files_api.delete_file, summary="Delete a file",
             operation_id="deleteFile", ok="Deleted",
             errors=("404", "503")),
        _row("GET", "/v1/files/{file_id}/content", files_api.file_content,
             summary="A file's bytes (JSONL)", operation_id="fileContent", ok="The bytes",
             content={"application/jsonl": {"type": "string"}},
             errors=("404", "503")),
        _row("POST", "/v1/batches", batch_api.create_batch, wrappers=(idempotent,),
             summary="Create a batch job from an uploaded file", operation_id="createBatch",
             ok="The batch object", body=Body(CreateBatch),
             errors=("404", "409", "503")),
        _row("GET", "/v1/batches", batch_api.list_batches,
             summary="This key's batch jobs, newest first", operation_id="listBatches",
             ok="A page of batch objects",
             params=(Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100,
                                              "default": 20}),
                     Param("after", "query", {"type": "string"})),
             errors=("503",)),
        _row("GET", "/v1/batches/{batch_id}", batch_api.get_batch,
             summary="A batch job: status, request_counts, output and error files",
             operation_id="getBatch", ok="The batch object",
             errors=("404", "503")),
        _row("POST", "/v1/batches/{batch_id}/cancel", batch_api.cancel_batch,
             summary="Cancel a batch job (cancelling, then cancelled)",
             operation_id="cancelBatch", ok="The batch object",
             errors=("404", "503")),
    )


def batch_runner(gateway: Gateway, policy: Policies = lambda _: OPEN) -> BatchRunner:
    """Started and closed with the app (its lifespan): see fleet.gateway.batch_runner.
    `policy`: a tenant's record (its fair-share weight), from the keys file."""
    return BatchRunner(gateway, BatchStore(gateway.backend._client), policy)
