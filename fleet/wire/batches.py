"""Batch jobs and their files (OpenAI's /v1/files and /v1/batches), as every gateway shares
them in NATS: records in KV FLEET_BATCHES, file bytes in the object store FLEET_FILES, one
result per request line on FLEET_BATCH_RESULTS, the job's runner lease in KV
FLEET_BATCH_LEASES, and the Idempotency-Key records of POSTs in KV FLEET_IDEMPOTENCY.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fleet.wire.base import Part, TaskId, Wire

BatchEndpoint = Literal[
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/images/generations",
]

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]

# A batch in one of these is done: its lease is gone and its record no longer changes.
FINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


class FileRecord(Wire):
    """An uploaded or produced file; its bytes are the FLEET_FILES object named by `id`.
    KV FLEET_BATCHES, key `file.<id>`."""

    type: Literal["file_record"] = "file_record"
    id: TaskId
    tenant: str | None = Field(default=None, description="None: made through an open gateway")
    filename: str
    purpose: Literal["batch", "batch_output"]
    bytes: int = Field(ge=0)
    created_at: int = Field(description="Unix time of the upload")


class RequestCounts(Part):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(Part):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchRecord(Wire):
    """A batch job as OpenAI reports it, plus its owner. KV FLEET_BATCHES, key
    `batch.<id>`; written with compare-and-set by the gateway that holds the job's lease
    (and by a cancel)."""

    type: Literal["batch_record"] = "batch_record"
    id: TaskId
    tenant: str | None = None
    endpoint: BatchEndpoint
    input_file_id: TaskId
    completion_window: Literal["24h"] = "24h"
    status: BatchStatus = "validating"
    created_at: int
    expires_at: int = Field(description="Unix time the completion window closes")
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    output_file_id: TaskId | None = None
    error_file_id: TaskId | None = None
    errors: list[BatchError] | None = None
    metadata: dict[str, str] | None = None


class BatchResult(Wire):
    """The outcome of one request line of a job: `fleet.batches.<batch_id>.<line>` on stream
    FLEET_BATCH_RESULTS, which keeps one message a subject (a second result is refused), so a
    line is counted once whichever gateway records it."""

    type: Literal["batch_result"] = "batch_result"
    batch_id: TaskId
    line: int = Field(ge=0, description="the request's line in the input file, from 0")
    custom_id: str
    task_id: TaskId | None = Field(default=None, description="None: refused before a task")
    status_code: int = Field(description="200, or the HTTP status the request would have had")
    body: dict[str, Any] = Field(description="the response body, or OpenAI's error object")


class BatchLease(Wire):
    """Which gateway runs a job now: KV FLEET_BATCH_LEASES, key = batch id, present while the
    job is not done. Renewed by its holder; another gateway takes it (compare-and-set) once
    `until` has passed."""

    type: Literal["batch_lease"] = "batch_lease"
    batch_id: TaskId
    owner: str = Field(description="the holding gateway's instance id")
    until: float = Field(description="Unix time the lease lapses unless renewed")


class IdempotencyRecord(Wire):
    """A POST made with an Idempotency-Key: KV FLEET_IDEMPOTENCY (kept 24 h), key
    `<tenant>.<sha256 of the key>`, created if absent. A retry with the same key and body
    attaches to what the first made (the ids derive from `seed`); with another body it is
    refused."""

    type: Literal["idempotency_record"] = "idempotency_record"
    path: str
    fingerprint: str = Field(description="sha256 hex of the method, path and body")
    seed: str = Field(pattern=r"^[A-Za-z0-9_-]{8,64}$",
                      description="what the first request's ids were made from")
    created_at: float
