"""Request-reply for NATS users: `nats req fleet.ask.<model> '<task json>'` is answered with
the task's final answer (an AskAnswer), or with an AskError when no answer can be given."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fleet.wire.base import Part, Sha256Hex, Wire
from fleet.wire.events import ErrorReason, Usage
from fleet.wire.tasks import ToolCall


class AskedImage(Part):
    """A final image of the task, stored in FLEET_IMAGES by its sha256."""

    sha256: Sha256Hex
    image_index: int = Field(ge=0)
    format: Literal["png", "jpeg", "webp"]
    width: int
    height: int


class AskAnswer(Wire):
    """How the asked task ended and what it made, folded from its stored events."""

    type: Literal["ask_answer"] = "ask_answer"
    task_id: str
    model: str
    status: Literal["completed", "failed", "cancelled", "expired"]
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    reason: ErrorReason | None = Field(default=None, description="why it did not complete")
    message: str | None = None
    text: str | None = Field(default=None, description="a text task's whole output")
    tool_calls: list[ToolCall] | None = None
    images: list[AskedImage] | None = Field(default=None, description="an image task's images")
    embeddings: list[list[float]] | list[str] | None = Field(
        default=None, description="an embeddings task's vectors, one per input in order (base64 "
        "of little-endian float32 when the task asked for base64)",
    )
    usage: Usage | None = None


AskErrorReason = Literal[
    "invalid_task", "model_not_found", "task_id_taken", "task_id_used", "invalid_task_id",
    "queue_full", "timeout", "busy", "unavailable", "stopped",
]


class AskError(Wire):
    """No answer: the ask was refused, or its task did not end in time (it may go on: follow
    `fleet.out.<task_id>`)."""

    type: Literal["ask_error"] = "ask_error"
    task_id: str | None = Field(default=None, description="the task's id, once it had one")
    reason: AskErrorReason = Field(
        description="invalid_task: the request is not a task; model_not_found: no model has "
        "the subject's name (nothing ran); task_id_taken / task_id_used / "
        "invalid_task_id: the worker refused the id; queue_full: the model's queue is full; "
        "timeout: no terminal within the ask timeout (the task may still run); busy: the "
        "answering worker has too many asks open; unavailable: NATS failed the ask; stopped: "
        "the answering worker stopped before the task ended"
    )
    message: str


AskReply = Annotated[AskAnswer | AskError, Field(discriminator="type")]
