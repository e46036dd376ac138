"""The OpenAPI paths of /v1/files and /v1/batches (fleet.gateway.openapi adds them)."""

from __future__ import annotations

from typing import Any

from fleet.gateway.batch_api import CreateBatch

_JSON = {"application/json": {"schema": {"type": "object"}}}
_ERROR = {"application/json": {"schema": {"type": "object"}}}


def _answers(ok: str, *errors: str, content: dict[str, Any] | None = None) -> dict[str, Any]:
    described = {"400": "Bad request", "401": "Missing or wrong API key", "404": "Unknown id",
                 "409": "Idempotency-Key reused with another request",
                 "413": "Body too large", "503": "NATS unavailable"}
    answers: dict[str, Any] = {"200": {"description": ok, "content": content or _JSON}}
    for status in ("400", "401", *errors):
        answers[status] = {"description": described[status], "content": _ERROR}
    return answers


def _id(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True,
            "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,128}$"}}


def batch_paths() -> dict[str, Any]:
    file_id, batch_id = [_id("file_id")], [_id("batch_id")]
    upload = {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["batch"]}}}
    limit = {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}}
    after = {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}
    return {
        "/v1/files": {
            "post": {"summary": "Upload a JSONL file of batch requests (purpose `batch`)",
                     "operationId": "uploadFile",
                     "requestBody": {"required": True,
                                     "content": {"multipart/form-data": {"schema": upload}}},
                     "responses": _answers("The file object", "409", "413", "503")},
            "get": {"summary": "This key's files", "operationId": "listFiles",
                    "parameters": [{"name": "purpose", "in": "query", "required": False,
                                    "schema": {"type": "string"}}],
                    "responses": _answers("A list of file objects", "503")},
        },
        "/v1/files/{file_id}": {
            "get": {"summary": "A file object", "operationId": "getFile",
                    "parameters": file_id, "responses": _answers("The file", "404", "503")},
            "delete": {"summary": "Delete a file", "operationId": "deleteFile",
                       "parameters": file_id,
                       "responses": _answers("Deleted", "404", "503")},
        },
        "/v1/files/{file_id}/content": {
            "get": {"summary": "A file's bytes (JSONL)", "operationId": "fileContent",
                    "parameters": file_id,
                    "responses": _answers("The bytes", "404", "503", content={
                        "application/jsonl": {"schema": {"type": "string"}}})},
        },
        "/v1/batches": {
            "post": {"summary": "Create a batch job from an uploaded file",
                     "operationId": "createBatch",
                     "requestBody": {"required": True, "content": {
                         "application/json": {"schema": CreateBatch.model_json_schema()}}},
                     "responses": _answers("The batch object", "404", "409", "503")},
            "get": {"summary": "This key's batch jobs, newest first", "operationId": "listBatches",
                    "parameters": [limit, after],
                    "responses": _answers("A page of batch objects", "503")},
        },
        "/v1/batches/{batch_id}": {
            "get": {"summary": "A batch job: status, request_counts, output and error files",
                    "operationId": "getBatch", "parameters": batch_id,
                    "responses": _answers("The batch object", "404", "503")},
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {"summary": "Cancel a batch job (cancelling, then cancelled)",
                     "operationId": "cancelBatch", "parameters": batch_id,
                     "responses": _answers("The batch object", "404", "503")},
        },
    }
