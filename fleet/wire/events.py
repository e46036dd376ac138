"""Everything about one task, in order, on `fleet.out.<task_id>` (stream FLEET_OUT)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from fleet.wire.base import ModelId, NodeId, Part, RunnerId, Sha256Hex, TaskId, Wire


class ErrorReason(StrEnum):
    """Why a task did not complete; each maps to one HTTP status in fleet.errors."""

    INVALID_TASK = "invalid_task"
    MODEL_NOT_FOUND = "model_not_found"
    UNSUPPORTED = "unsupported"
    CONTEXT_LENGTH = "context_length"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    RUNNER_CRASHED = "runner_crashed"
    WORKER_LOST = "worker_lost"
    MAX_DELIVERIES = "max_deliveries"
    INPUT_MISSING = "input_missing"
    INPUT_CORRUPT = "input_corrupt"
    OUTPUT_LOST = "output_lost"  # the broker could not store the output whole and in order
    QUEUE_FULL = "queue_full"
    INTERNAL = "internal"


class _Event(Wire):
    task_id: TaskId
    at: float = Field(description="Unix time in seconds when the event was made")


class TaskAccepted(_Event):
    type: Literal["task_accepted"] = "task_accepted"
    model: ModelId
    node_id: NodeId
    runner_id: RunnerId
    trace_id: str | None = Field(default=None, description="W3C trace id, 32 hex digits")
    queue_wait_s: float = 0.0
    delivery: int = Field(default=1, description="JetStream delivery count of the task")
    continued_from: int = Field(
        default=0, ge=0,
        description="a continued task: the token index this attempt goes on from (0: a fresh "
        "start); the events before it were streamed by an earlier attempt",
    )
    attempt: int = Field(
        default=0, ge=0, description="0 for the first run; k for the task's k-th continuation"
    )
    moved_from: NodeId | None = Field(
        default=None,
        description="a continued task: the node its previous attempt ran on (the same node "
        "when only its runner was lost)",
    )
    seed: int | None = Field(
        default=None, ge=-(2**63), le=2**64 - 1,
        description="a sampled text task: the seed it samples with; the request's, or one the "
        "worker fixed at the first attempt, which every continuation reuses (so an unseeded "
        "task also continues exactly)",
    )


class TopLogprob(Part):
    token: str
    token_id: int
    logprob: float


class TokenChunk(_Event):
    """One or more consecutive tokens of a task. A runner coalesces tokens made close
    together (within a few milliseconds, at most 16) into one event: `index` is then the first
    token's index, `token_ids` lists every token's id, and `text` is their text joined. The next
    token event of the task starts at index `index + len(token_ids)` (`index + 1` without
    `token_ids`). A task's first token always comes alone; a token with logprobs too."""

    type: Literal["token"] = "token"
    index: int = Field(ge=0, description="the index of the (first) token, counted from 0")
    token_id: int = Field(description="the (first) token's id")
    text: str = Field(description="the text of the event's tokens, joined")
    token_ids: list[int] | None = Field(
        default=None, min_length=2,
        description="an event of several tokens: every token id in order (the first is "
        "token_id); absent for one token",
    )
    logprob: float | None = Field(default=None, description="a single token's log probability")
    top_logprobs: list[TopLogprob] | None = None
    at: float = Field(description="Unix time in seconds when the (first) token was made")

    @model_validator(mode="after")
    def _tokens_agree(self) -> TokenChunk:
        if self.token_ids is not None:
            if self.token_ids[0] != self.token_id:
                raise ValueError("token_ids must start with token_id")
            if self.logprob is not None or self.top_logprobs:
                raise ValueError("an event of several tokens carries no logprobs")
        return self

    @property
    def ids(self) -> list[int]:
        """Every token id the event carries, in order."""
        return self.token_ids if self.token_ids is not None else [self.token_id]

    @property
    def count(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 1

    @property
    def next_index(self) -> int:
        """The index of the task's next token after this event."""
        return self.index + self.count


def token_indexes(events: Iterable[object]) -> list[int]:
    """Every token index the events carry, in their order (an event may carry several)."""
    return [event.index + k for event in events if isinstance(event, TokenChunk)
            for k in range(event.count)]


class ToolCallChunk(_Event):
    type: Literal["tool_call"] = "tool_call"
    index: int = Field(ge=0)
    id: str
    name: str
    arguments: str


class ImageStats(Part):
    seconds_per_step: float
    total_s: float
    steps: int


class ImageChunk(_Event):
    """An image (or a preview when partial_index is set) stored in FLEET_IMAGES by hash."""

    type: Literal["image"] = "image"
    sha256: Sha256Hex
    image_index: int = Field(ge=0)
    partial_index: int | None = None
    partial_total: int | None = None
    format: Literal["png", "jpeg", "webp"]
    width: int
    height: int
    size_bytes: int
    stats: ImageStats | None = None


class EmbeddingChunk(_Event):
    """The vectors of consecutive inputs of an embeddings task, `index` the first one's
    position in the task's `input`. A task's vectors come in one or more of these (a large
    request is split so each event stays far under NATS's max_payload), then its terminal."""

    type: Literal["embedding"] = "embedding"
    index: int = Field(ge=0, description="the input index of the first vector")
    encoding_format: Literal["float", "base64"]
    embeddings: list[list[float]] | list[str] = Field(
        min_length=1, description="one vector per input: JSON numbers, or base64 of "
        "little-endian float32 when encoding_format is base64",
    )
    dimensions: int = Field(ge=1)
    forward_pass: int = Field(
        ge=1, description="the runner's count of engine calls when these were computed: "
        "events of the same runner with the same number shared one forward pass",
    )


class ErrorChunk(_Event):
    """A failure, told in words; the task's terminal event follows it."""

    type: Literal["error"] = "error"
    reason: ErrorReason
    message: str


class Usage(Part):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = Field(
        default=0, description="Prompt tokens whose prefill the runner's prefix cache saved"
    )
    images: int = Field(default=0, description="Input images of a vision task")
    cached_images: int = Field(
        default=0, description="Of them, images whose encoding the vision cache saved"
    )


class TaskStats(Part):
    queue_wait_s: float | None = None
    time_to_first_token_s: float | None = None
    tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    total_s: float | None = None
    batched_with: int | None = Field(
        default=None, description="Most other tasks sharing the runner's batch with this one"
    )


class TaskFinished(_Event):
    """The one terminal event of every task."""

    type: Literal["task_finished"] = "task_finished"
    status: Literal["completed", "failed", "cancelled", "expired"]
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_sequence: str | None = Field(
        default=None, description="the task's stop string that ended the text (finish_reason "
        "stop); absent when the model's end of sequence did")
    reason: ErrorReason | None = None
    message: str | None = None
    usage: Usage | None = None
    stats: TaskStats | None = None
    node_id: NodeId | None = None
    runner_id: RunnerId | None = None
    last_tokens: list[TokenChunk] | None = Field(
        default=None, description="The task's last token event(s), stored inside its terminal "
        "when its runner reported them together (one message a task fewer; issue 23). A reader "
        "takes them as the token events just before this terminal, in order, and the terminal "
        "as it is without them (fleet.wire.codec.decode_events). Each is of this task, and "
        "their indexes follow on.")

    @model_validator(mode="after")
    def _last_tokens_follow_on(self) -> TaskFinished:
        tokens = self.last_tokens
        if tokens is None:
            return self
        if not tokens:
            raise ValueError("last_tokens, when present, holds at least one token event")
        if any(token.task_id != self.task_id for token in tokens):
            raise ValueError("last_tokens must be the task's own token events")
        if any(later.index != earlier.next_index
               for earlier, later in itertools.pairwise(tokens)):
            raise ValueError("last_tokens' indexes must follow on")
        return self


OutputEvent = Annotated[
    TaskAccepted | TokenChunk | ToolCallChunk | ImageChunk | EmbeddingChunk | ErrorChunk
    | TaskFinished,
    Field(discriminator="type"),
]


class TaskFence(Wire):
    """The fence of a task's output, on `fleet.out.<task_id>.fence` (stream FLEET_OUT): one
    message per takeover. Every event of an attempt is published with
    `Nats-Expected-Last-Subject-Sequence` naming the fence it wrote (0: the first attempt, no
    fence yet), so once another attempt has written a newer fence the stream refuses the old
    attempt's late events (fleet.worker.takeover). No reader of the task's events sees it."""

    type: Literal["task_fence"] = "task_fence"
    task_id: TaskId
    attempt: int = Field(ge=1, description="the attempt that took the task over (1, 2, ...)")
    node_id: NodeId = Field(description="the node that took it over")
    delivery: int = Field(ge=1, description="the JetStream delivery count it took it over on")
    at: float = Field(description="Unix time in seconds when the fence was written")


RefusedReason = Literal["task_id_taken", "task_id_used", "invalid_task_id"]


class TaskRefused(Wire):
    """A task message refused WITHOUT writing on `fleet.out.<task_id>`: that subject belongs to
    another message (or to none, when the id cannot be a subject token). Recorded on
    `fleet.refused.<model>` (stream FLEET_REFUSED) and sent to the publisher's
    `Fleet-Reply-To` inbox when it set one. Not an OutputEvent: it is about a message, not
    about the task that owns the id."""

    type: Literal["task_refused"] = "task_refused"
    task_id: str | None = Field(
        default=None, description="The task_id as sent (possibly not a valid id), if any"
    )
    model: str = Field(description="The model part of the subject the task was sent to")
    reason: RefusedReason = Field(
        description="task_id_taken: another task message holds this id; task_id_used: the id "
        "already has events in FLEET_OUT; invalid_task_id: missing, or not one subject token "
        "of [A-Za-z0-9_-], 1 to 128 characters"
    )
    message: str
    at: float = Field(description="Unix time in seconds when the task was refused")
    stream_seq: int | None = Field(
        default=None, description="The refused message's sequence in FLEET_TASKS, when known"
    )


def failed(task_id: str, at: float, reason: ErrorReason, message: str) -> TaskFinished:
    status: Literal["failed", "cancelled", "expired"] = "failed"
    if reason is ErrorReason.CANCELLED:
        status = "cancelled"
    elif reason is ErrorReason.DEADLINE:
        status = "expired"
    return TaskFinished(task_id=task_id, at=at, status=status, reason=reason, message=message)
