"""The one table from an error's code to its HTTP status (fleet/errors.py), table-tested: each
wire reason and each error class answers with the status a client expects."""

from __future__ import annotations

from typing import get_args

import pytest

from fleet.errors import (
    STATUS_BY_CODE,
    AtCapacity,
    BrokerUnavailable,
    CorruptImage,
    DeadlineExceeded,
    FleetError,
    HttpError,
    ImageCorrupt,
    InputCorrupt,
    InputMissing,
    InvalidRequest,
    InvalidSetting,
    ModelNotFound,
    ModelUnavailable,
    NatsUnavailable,
    NotPermitted,
    ObjectMissing,
    PayloadTooLarge,
    QueueFull,
    RequestTimeout,
    StreamIdle,
    TaskFailed,
    TaskRejected,
    Unauthorized,
    http_answer,
)
from fleet.wire.ask import AskErrorReason
from fleet.wire.events import ErrorReason


def test_every_wire_reason_has_a_status() -> None:
    missing = {r.value for r in ErrorReason} | set(get_args(AskErrorReason))
    assert missing - STATUS_BY_CODE.keys() == set()


@pytest.mark.parametrize(
    ("reason", "status", "openai_type"),
    [
        (ErrorReason.INVALID_TASK, 400, "invalid_request_error"),
        (ErrorReason.UNSUPPORTED, 400, "invalid_request_error"),
        (ErrorReason.CONTEXT_LENGTH, 400, "invalid_request_error"),
        (ErrorReason.INPUT_MISSING, 400, "invalid_request_error"),
        (ErrorReason.INPUT_CORRUPT, 400, "invalid_request_error"),
        (ErrorReason.MODEL_NOT_FOUND, 404, "invalid_request_error"),
        (ErrorReason.QUEUE_FULL, 429, "rate_limit_error"),
        (ErrorReason.CANCELLED, 499, "cancelled"),
        (ErrorReason.DEADLINE, 504, "timeout"),
        (ErrorReason.RUNNER_CRASHED, 502, "server_error"),
        (ErrorReason.WORKER_LOST, 502, "server_error"),
        (ErrorReason.MAX_DELIVERIES, 502, "server_error"),
        (ErrorReason.OUTPUT_LOST, 502, "server_error"),
        (ErrorReason.INTERNAL, 500, "server_error"),
    ],
)
def test_a_failed_task_answers_with_its_reasons_status(
    reason: ErrorReason, status: int, openai_type: str
) -> None:
    failed = TaskFailed(reason, "x")
    assert (failed.http_status, failed.openai_type, failed.reason) == (status, openai_type, reason)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("invalid_task", 400), ("invalid_task_id", 400), ("task_id_taken", 409),
        ("task_id_used", 409), ("queue_full", 429), ("busy", 429), ("unavailable", 503),
        ("stopped", 503), ("timeout", 504),
    ],
)
def test_an_ask_error_has_the_status_its_nats_reply_carries(code: str, status: int) -> None:
    assert http_answer(code).status == status


@pytest.mark.parametrize(
    ("error", "status", "code", "reason"),
    [
        (FleetError("x"), 500, "internal", ErrorReason.INTERNAL),
        (InvalidRequest("x"), 400, "invalid_task", ErrorReason.INVALID_TASK),
        (Unauthorized("x"), 401, "invalid_api_key", ErrorReason.INTERNAL),
        (ModelNotFound("x"), 404, "model_not_found", ErrorReason.MODEL_NOT_FOUND),
        (RequestTimeout("x"), 408, "request_timeout", ErrorReason.INTERNAL),
        (PayloadTooLarge("x"), 413, "payload_too_large", ErrorReason.INTERNAL),
        (QueueFull("x"), 429, "queue_full", ErrorReason.QUEUE_FULL),
        (AtCapacity("x"), 429, "queue_full", ErrorReason.QUEUE_FULL),
        (InputMissing("ab", "x"), 400, "input_missing", ErrorReason.INPUT_MISSING),
        (InputCorrupt("ab", "x"), 400, "input_corrupt", ErrorReason.INPUT_CORRUPT),
        (ImageCorrupt("x"), 400, "input_corrupt", ErrorReason.INPUT_CORRUPT),
        (CorruptImage("x"), 502, "image_corrupt", ErrorReason.INTERNAL),
        (NatsUnavailable("x"), 503, "nats_unavailable", ErrorReason.INTERNAL),
        (BrokerUnavailable("x"), 503, "nats_unavailable", ErrorReason.INTERNAL),
        (NotPermitted("x"), 503, "not_permitted", ErrorReason.INTERNAL),
        (ModelUnavailable("x"), 503, "model_unavailable", ErrorReason.INTERNAL),
        (DeadlineExceeded("x"), 504, "deadline", ErrorReason.DEADLINE),
        (StreamIdle("x"), 504, "idle", ErrorReason.INTERNAL),
        (ObjectMissing("x"), 500, "internal", ErrorReason.INTERNAL),
        (HttpError(404, "x"), 404, "not_found", ErrorReason.INTERNAL),
        (HttpError(405, "x"), 405, "method_not_allowed", ErrorReason.INTERNAL),
        (HttpError(400, "x"), 400, "invalid_task", ErrorReason.INVALID_TASK),
        (TaskRejected(ErrorReason.UNSUPPORTED, "x"), 400, "unsupported", ErrorReason.UNSUPPORTED),
    ],
)
def test_each_error_reads_status_and_reason_from_its_code(
    error: FleetError, status: int, code: str, reason: ErrorReason
) -> None:
    assert (error.http_status, error.code, error.reason) == (status, code, reason)


def test_a_bad_setting_is_not_a_bad_request() -> None:
    """An operator's bad flag is its own type: never an HTTP 400 a client caused."""
    assert not isinstance(InvalidSetting("x"), InvalidRequest)


def test_an_unknown_code_is_a_server_error() -> None:
    assert http_answer("no-such-code") == STATUS_BY_CODE["internal"]
