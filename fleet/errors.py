"""The error tree. Each error knows its wire reason and its HTTP status.

    FleetError
     ├── InvalidRequest        400  invalid_task
     ├── InvalidSetting             a flag or FLEET_* variable has a bad value (CLI exit 2)
     ├── Unauthorized          401
     ├── ModelNotFound         404  model_not_found
     ├── PayloadTooLarge       413
     ├── QueueFull             429  queue_full
     ├── NatsUnavailable       503
     ├── ModelUnavailable      503  model_unavailable: no live node can serve the model
     ├── DeadlineExceeded      504  deadline
     ├── ProvisioningConflict       an existing stream differs from ops/jetstream
     ├── EmbeddedServerError        the embedded nats-server could not start
     └── TaskFailed            by reason: the worker ended the task failed
"""

from __future__ import annotations

from fleet.wire.events import ErrorChunk, ErrorReason, TaskFinished


class FleetError(Exception):
    http_status = 500
    reason = ErrorReason.INTERNAL
    openai_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(FleetError):
    http_status = 400
    reason = ErrorReason.INVALID_TASK
    openai_type = "invalid_request_error"


class InvalidSetting(FleetError):
    """A bad flag or environment value: the operator's mistake, not a client's request."""


class Unauthorized(FleetError):
    http_status = 401
    openai_type = "authentication_error"


class ModelNotFound(FleetError):
    http_status = 404
    reason = ErrorReason.MODEL_NOT_FOUND
    openai_type = "invalid_request_error"


class PayloadTooLarge(FleetError):
    http_status = 413
    openai_type = "invalid_request_error"


class QueueFull(FleetError):
    http_status = 429
    reason = ErrorReason.QUEUE_FULL
    openai_type = "rate_limit_error"


class NatsUnavailable(FleetError):
    http_status = 503
    openai_type = "service_unavailable"


class ModelUnavailable(FleetError):
    """Workers are up and none can serve the model (no files, memory or disk room)."""

    http_status = 503
    openai_type = "service_unavailable"
    code = "model_unavailable"


class DeadlineExceeded(FleetError):
    http_status = 504
    reason = ErrorReason.DEADLINE
    openai_type = "timeout"


class ProvisioningConflict(FleetError):
    pass


class ProvisioningDenied(FleetError):
    """This process's NATS user may not create what is missing (only the operator role
    may): a retry cannot help, so it is said at once."""


class EmbeddedServerError(FleetError):
    pass


HTTP_STATUS_BY_REASON: dict[ErrorReason, int] = {
    ErrorReason.INVALID_TASK: 400,
    ErrorReason.UNSUPPORTED: 400,
    ErrorReason.CONTEXT_LENGTH: 400,
    ErrorReason.INPUT_MISSING: 400,
    ErrorReason.INPUT_CORRUPT: 400,
    ErrorReason.MODEL_NOT_FOUND: 404,
    ErrorReason.QUEUE_FULL: 429,
    ErrorReason.CANCELLED: 499,
    ErrorReason.DEADLINE: 504,
    ErrorReason.RUNNER_CRASHED: 502,
    ErrorReason.WORKER_LOST: 502,
    ErrorReason.MAX_DELIVERIES: 502,
    ErrorReason.OUTPUT_LOST: 502,
    ErrorReason.INTERNAL: 500,
}


class TaskFailed(FleetError):
    """A task that a worker ended failed; raised by clients that wait for one."""

    def __init__(self, reason: ErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.http_status = HTTP_STATUS_BY_REASON.get(reason, 500)


def failure_of(finished: TaskFinished, last_error: ErrorChunk | None = None) -> TaskFailed | None:
    """The error a terminal event stands for, or None when the task completed."""
    if finished.status == "completed":
        return None
    default = {"cancelled": ErrorReason.CANCELLED, "expired": ErrorReason.DEADLINE}
    reason = finished.reason or default.get(finished.status, ErrorReason.INTERNAL)
    message = finished.message or (last_error.message if last_error else None)
    return TaskFailed(reason, message or f"task {finished.status}: {reason.value}")
