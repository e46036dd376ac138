"""Pure rules of batch jobs: an input file's lines, the output and error files' lines, the
job's counts and its final status. No I/O and no clock (`now` is passed in)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, get_args

import orjson

from fleet.wire.batches import BatchEndpoint, BatchError, BatchRecord, BatchResult, RequestCounts

MAX_LINES = 50_000
ENDPOINTS: tuple[str, ...] = get_args(BatchEndpoint)
WINDOW_S = {"24h": 24 * 3600}


@dataclass(frozen=True)
class InputLine:
    line: int
    custom_id: str
    body: dict[str, Any]


def parse_input(data: bytes, endpoint: str) -> tuple[list[InputLine], list[BatchError]]:
    """The request lines of an input file, or the errors that fail the whole job (as OpenAI's
    validation does): a line that is not JSON, a missing or repeated custom_id, a method
    other than POST, a url other than the job's endpoint, a body that is not an object."""
    lines: list[InputLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines()):
        if not raw.strip():
            continue
        if error := _line_error(raw, number, endpoint, seen):
            errors.append(error)
            if len(errors) >= 100:
                break
            continue
        item = orjson.loads(raw)
        seen.add(item["custom_id"])
        lines.append(InputLine(len(lines), item["custom_id"], item["body"]))
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="the input file has no requests"))
    if len(lines) > MAX_LINES:
        errors.append(BatchError(code="too_many_requests",
                                 message=f"{len(lines)} requests; a job takes at most {MAX_LINES}"))
    return lines, errors


def _line_error(raw: bytes, number: int, endpoint: str, seen: set[str]) -> BatchError | None:
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return BatchError(code="invalid_json_line", message="this line is not JSON", line=number)
    if not isinstance(item, dict):
        return BatchError(code="invalid_request", message="a line must be an object", line=number)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchError(code="missing_required_parameter", param="custom_id", line=number,
                          message="each line needs a custom_id (a string)")
    if custom_id in seen:
        return BatchError(code="duplicate_custom_id", param="custom_id", line=number,
                          message=f"custom_id {custom_id!r} is used more than once")
    if item.get("method") != "POST":
        return BatchError(code="invalid_method", param="method", line=number,
                          message="the method must be POST")
    if item.get("url") != endpoint:
        return BatchError(code="mismatched_endpoint", param="url", line=number,
                          message=f"the url must be the job's endpoint {endpoint}")
    if not isinstance(item.get("body"), dict):
        return BatchError(code="invalid_request", param="body", line=number,
                          message="the body must be an object")
    return None


def task_id_of(batch_id: str, line: int) -> str:
    """A line's task id: the same for every gateway that runs the job, so a line published
    again is the same task (deduplicated by Nats-Msg-Id and held by its FLEET_CLAIMS claim)."""
    return f"{batch_id}-{line}"


def output_line(result: BatchResult) -> dict[str, Any]:
    """One line of the output (status 200) or error file, in OpenAI's shape."""
    request_id = result.task_id or f"{result.batch_id}-{result.line}"
    line: dict[str, Any] = {
        "id": f"batch_req_{request_id}", "custom_id": result.custom_id,
        "response": {"status_code": result.status_code, "request_id": request_id,
                     "body": result.body},
        "error": None,
    }
    return line


def split_files(results: Iterable[BatchResult]) -> tuple[bytes, bytes]:
    """(output file, error file) as JSONL, in line order."""
    output, errors = [], []
    for result in sorted(results, key=lambda r: r.line):
        (output if result.status_code == 200 else errors).append(
            orjson.dumps(output_line(result)) + b"\n")
    return b"".join(output), b"".join(errors)


def counts(total: int, results: Iterable[BatchResult]) -> RequestCounts:
    done = list(results)
    completed = sum(1 for r in done if r.status_code == 200)
    return RequestCounts(total=total, completed=completed, failed=len(done) - completed)


def final_status(record: BatchRecord, recorded: int, now: float) -> str | None:
    """What a running job becomes, or None while it goes on: cancelled once a cancel asked
    and nothing is in flight any more (the caller says so by asking), completed when every
    line has a result, expired when its window closed first."""
    if record.status == "cancelling":
        return "cancelled"
    if recorded >= record.request_counts.total:
        return "completed"
    if now >= record.expires_at:
        return "expired"
    return None


def expired_body(batch_id: str) -> dict[str, Any]:
    return {"error": {"message": f"batch {batch_id} expired before this request ran",
                      "type": "batch_expired", "param": None, "code": "batch_expired"}}


def openai_batch(record: BatchRecord) -> dict[str, Any]:
    """The Batch object OpenAI's API returns."""
    body = record.model_dump(mode="json", exclude={"type", "schema_version", "tenant", "errors"})
    body["object"] = "batch"
    body["errors"] = (
        {"object": "list", "data": [e.model_dump(mode="json") for e in record.errors]}
        if record.errors else None
    )
    return body
