"""The error tree, and the one table from an error's code to its HTTP status.

Every failure Fleet raises on purpose is a FleetError with a `code`: its wire reason
(`ErrorReason` on `fleet.out`, `AskErrorReason` on `fleet.ask`) when it travels on the wire, a
code of its own otherwise. `STATUS_BY_CODE` maps every code to one HTTP status and OpenAI
error type: the gateway answers with it, the worker's asks send it as Nats-Service-Error-Code.
An error's `http_status`, `openai_type` and wire `reason` are read from its code, so they
cannot disagree.

    FleetError                          internal           500
     ├── InvalidRequest                 invalid_task       400
     │    └── InvalidParameter          names the request parameter, as OpenAI's `param`
     ├── Unauthorized                   invalid_api_key    401
     ├── ModelNotFound                  model_not_found    404
     ├── RequestTimeout                 request_timeout    408  the body did not arrive in time
     ├── HttpError                      not_found, method_not_allowed: a routing failure
     ├── PayloadTooLarge                payload_too_large  413
     ├── QueueFull                      queue_full         429
     │    └── AtCapacity                too many requests wait at this gateway (Retry-After)
     ├── InputMissing, InputCorrupt     input_missing, input_corrupt  400  a task's input image
     ├── CorruptImage                   image_corrupt      502  a stored output is not its hash
     ├── NatsUnavailable                nats_unavailable   503
     │    └── BrokerUnavailable         a broker call failed for its whole retry budget
     ├── NotPermitted                   not_permitted      503  the server refused a publish by
     │                                                          permission: no retry can help
     ├── ModelUnavailable               model_unavailable  503  no live node can serve the model
     ├── DeadlineExceeded               deadline           504
     │    └── StreamIdle                idle               504  a resumed stream saw nothing
     ├── TaskFailed                     the reason the worker ended the task with
     ├── TaskRejected                   the reason a runner's engine refused the task with
     ├── ObjectError                    internal           500  the object store (bus/objects)
     │    ├── BucketMissing, ObjectMissing, ObjectExists, ObjectTimeout
     │    └── ObjectCorrupt
     │         └── ImageCorrupt         input_corrupt      400  bytes that are not their name
     ├── PlacementError                 no node can take the instance (the reasons, per node)
     ├── DiskBudgetExceeded             --models-disk-limit leaves no room for the model
     ├── ProvisioningConflict           an existing stream differs from ops/jetstream
     ├── ProvisioningDenied             this NATS user may not create what is missing
     ├── EmbeddedServerError            the embedded nats-server could not start
     └── InvalidSetting                 a flag or FLEET_* value is bad: the operator's mistake,
                                        never an HTTP answer (the CLI exits 2)

The wire's own errors (`DecodeError`, `FrameError`) are exceptions of `fleet.wire`, which
imports nothing else of Fleet; the processes turn them into `invalid_task` where a task is
concerned. Exceptions that only carry control inside one module (a runner's cancelled
generation, a refused claim, a stop request) stay private to it.
"""

from __future__ import annotations

from typing import NamedTuple

from fleet.wire.events import ErrorChunk, ErrorReason, TaskFinished


class HttpAnswer(NamedTuple):
    status: int
    openai_type: str


_BAD = HttpAnswer(400, "invalid_request_error")
_TOO_MANY = HttpAnswer(429, "rate_limit_error")
_LOST = HttpAnswer(502, "server_error")
_DOWN = HttpAnswer(503, "service_unavailable")
_TIMEOUT = HttpAnswer(504, "timeout")

# The one table. Keys: every ErrorReason value, every AskErrorReason value, and the codes of
# errors that never travel on the wire (tests/test_error_table.py checks each family is covered).
STATUS_BY_CODE: dict[str, HttpAnswer] = {
    # ErrorReason: why a task did not complete
    "invalid_task": _BAD,
    "unsupported": _BAD,
    "context_length": _BAD,
    "input_missing": _BAD,
    "input_corrupt": _BAD,
    "model_not_found": HttpAnswer(404, "invalid_request_error"),
    "queue_full": _TOO_MANY,
    "cancelled": HttpAnswer(499, "cancelled"),
    "deadline": _TIMEOUT,
    "runner_crashed": _LOST,
    "worker_lost": _LOST,
    "max_deliveries": _LOST,
    "output_lost": _LOST,
    "internal": HttpAnswer(500, "server_error"),
    # AskErrorReason: why an ask on fleet.ask.<model> got no answer
    "invalid_task_id": _BAD,
    "task_id_taken": HttpAnswer(409, "invalid_request_error"),
    "task_id_used": HttpAnswer(409, "invalid_request_error"),
    "busy": _TOO_MANY,
    "unavailable": _DOWN,
    "stopped": _DOWN,
    "timeout": _TIMEOUT,
    # Never on the wire
    "invalid_api_key": HttpAnswer(401, "authentication_error"),
    "not_found": HttpAnswer(404, "invalid_request_error"),
    "method_not_allowed": HttpAnswer(405, "invalid_request_error"),
    "request_timeout": HttpAnswer(408, "invalid_request_error"),
    "payload_too_large": HttpAnswer(413, "invalid_request_error"),
    "image_corrupt": _LOST,
    "nats_unavailable": _DOWN,
    "not_permitted": _DOWN,
    "model_unavailable": _DOWN,
    "idle": _TIMEOUT,
}
WIRE_REASONS = frozenset(reason.value for reason in ErrorReason)


def http_answer(code: str) -> HttpAnswer:
    """The HTTP status and OpenAI error type of a code (an unknown code is a server error)."""
    return STATUS_BY_CODE.get(code, STATUS_BY_CODE["internal"])


class FleetError(Exception):
    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def http_status(self) -> int:
        return http_answer(self.code).status

    @property
    def openai_type(self) -> str:
        return http_answer(self.code).openai_type

    @property
    def reason(self) -> ErrorReason:
        """The reason a task ends with when this error ends it."""
        return ErrorReason(self.code) if self.code in WIRE_REASONS else ErrorReason.INTERNAL


class InvalidRequest(FleetError):
    code = "invalid_task"


class InvalidSetting(FleetError):
    """A bad flag or environment value: the operator's mistake, not a client's request."""


class Unauthorized(FleetError):
    code = "invalid_api_key"


class ModelNotFound(FleetError):
    code = "model_not_found"


class RequestTimeout(FleetError):
    code = "request_timeout"


class HttpError(FleetError):
    """A routing failure (no such path, wrong method) in OpenAI's error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_task")

    @property
    def http_status(self) -> int:
        return self.status  # whatever the router said, even a status the table has no code for


class PayloadTooLarge(FleetError):
    code = "payload_too_large"


class QueueFull(FleetError):
    code = "queue_full"


class InputMissing(FleetError):
    """A task's input image is not in the store (or could not be read) in time."""

    code = "input_missing"

    def __init__(self, sha: str, message: str) -> None:
        super().__init__(message)
        self.sha = sha


class InputCorrupt(FleetError):
    """A task's input image is stored under a name that is not its hash."""

    code = "input_corrupt"

    def __init__(self, sha: str, message: str) -> None:
        super().__init__(message)
        self.sha = sha


class CorruptImage(FleetError):
    """The store holds bytes under a name that is not their hash; never served."""

    code = "image_corrupt"


class NatsUnavailable(FleetError):
    code = "nats_unavailable"


class ServerTooOld(NatsUnavailable):
    """The NATS server is older than Fleet's roles need (fleet.bus.server_version)."""


class NotPermitted(FleetError):
    """The server refused this process's publish by permission (its NATS user's role lacks
    it): the call fails at once rather than time out and be retried as an election."""

    code = "not_permitted"


class ModelUnavailable(FleetError):
    """Workers are up and none can serve the model (no files, memory or disk room)."""

    code = "model_unavailable"


class DeadlineExceeded(FleetError):
    code = "deadline"


class ProvisioningConflict(FleetError):
    pass


class ProvisioningDenied(FleetError):
    """This process's NATS user may not create what is missing (only the operator role
    may): a retry cannot help, so it is said at once."""


class EmbeddedServerError(FleetError):
    pass


class TaskFailed(FleetError):
    """A task that a worker ended failed; raised by clients that wait for one."""

    def __init__(self, reason: ErrorReason, message: str) -> None:
        super().__init__(message)
        self.code = reason.value


class ObjectError(FleetError):
    pass


class BucketMissing(ObjectError):
    pass


class ObjectMissing(ObjectError):
    pass


class ObjectExists(ObjectError):
    pass


class ObjectCorrupt(ObjectError):
    pass


class ImageCorrupt(ObjectCorrupt):
    """An object named by a sha256 whose bytes are something else: refused, never served."""

    code = "input_corrupt"


class ObjectTimeout(ObjectError):
    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # the broker did not answer (a restart, an election)


class BrokerUnavailable(NatsUnavailable):
    """A broker call kept failing for its whole retry budget."""


class StreamIdle(DeadlineExceeded):
    """An event stream that saw nothing for its idle limit (a resume of a quiet task)."""

    code = "idle"


class AtCapacity(QueueFull):
    """429: too many requests are waiting (for this key, or in all); retry after a moment."""

    retry_after_s = 1  # a waiting place frees as soon as any request ends


class InvalidParameter(InvalidRequest):
    """A 400 that names the offending request parameter, as OpenAI's `param` does."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class PlacementError(FleetError):
    pass


class DiskBudgetExceeded(FleetError):
    pass


class TaskRejected(FleetError):
    """A task an engine will not start; the runner ends it failed with this reason."""

    def __init__(self, reason: ErrorReason, message: str) -> None:
        super().__init__(message)
        self.code = reason.value


def failure_of(finished: TaskFinished, last_error: ErrorChunk | None = None) -> TaskFailed | None:
    """The error a terminal event stands for, or None when the task completed."""
    if finished.status == "completed":
        return None
    default = {"cancelled": ErrorReason.CANCELLED, "expired": ErrorReason.DEADLINE}
    reason = finished.reason or default.get(finished.status, ErrorReason.INTERNAL)
    message = finished.message or (last_error.message if last_error else None)
    return TaskFailed(reason, message or f"task {finished.status}: {reason.value}")
