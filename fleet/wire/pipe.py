"""The worker <-> runner pipe: typed messages, framed as 4-byte big-endian length + JSON.

Commands flow worker -> runner (imperative names); reports flow runner -> worker. Task
output uses the very wire events published on `fleet.out.<task_id>`.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import Field, TypeAdapter

from fleet.wire.base import InstanceId, NodeId, RunnerId, Wire
from fleet.wire.cluster import ModelCard
from fleet.wire.events import (
    EmbeddingChunk,
    ErrorChunk,
    ImageChunk,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.ring import GroupSpec
from fleet.wire.runners import RunnerStatus
from fleet.wire.tasks import CancelTask, Task


class RunnerSpec(Wire):
    """Everything a runner subprocess needs to start; given to it as JSON on argv."""

    type: Literal["runner_spec"] = "runner_spec"
    runner_id: RunnerId
    instance_id: InstanceId
    node_id: NodeId
    card: ModelCard
    model_path: str
    images_dir: str
    slots: int = 4
    group: GroupSpec | None = Field(
        default=None, description="a shard of a sharded instance: its rank, layers and ring"
    )


class ConnectToGroup(Wire):
    type: Literal["connect_to_group"] = "connect_to_group"


class LoadModel(Wire):
    type: Literal["load_model"] = "load_model"


class WarmUp(Wire):
    type: Literal["warm_up"] = "warm_up"


class SubmitTask(Wire):
    type: Literal["submit_task"] = "submit_task"
    task: Task
    inputs: dict[str, str] = Field(default_factory=dict, description="sha256 -> local file")
    queue_wait_s: float = 0.0
    delivery: int = 1
    generated: list[int] = Field(
        default_factory=list,
        description="a continued text task: the token ids its earlier attempts streamed",
    )
    attempt: int = Field(default=0, description="k for a task's k-th continuation")
    delivered_images: list[str] = Field(
        default_factory=list,
        description="a restarted image task: the images and previews already delivered, as "
        "'<image>.<preview>' or '<image>.final'",
    )
    traceparent: str | None = None
    tracestate: str | None = None


class Shutdown(Wire):
    type: Literal["shutdown"] = "shutdown"


RunnerCommand = Annotated[
    ConnectToGroup | LoadModel | WarmUp | SubmitTask | CancelTask | Shutdown,
    Field(discriminator="type"),
]


class RunnerStatusReport(Wire):
    type: Literal["runner_status"] = "runner_status"
    status: RunnerStatus


TraceId = Annotated[str, Field(pattern="^[0-9a-f]{32}$")]


class SpanBatch(Wire):
    """Finished OpenTelemetry spans from the runner (span records, fleet/trace/records.py),
    exported by the worker. `spans` holds runs of records of one trace each, and `traces` says
    where each run lies in the frame, so that the worker splits a frame into the runs'
    bytes and publishes them without reading a record (fleet.wire.token_frames.read_report;
    framing.span_batch_of writes one)."""

    type: Literal["spans"] = "spans"
    traces: list[tuple[TraceId, Annotated[int, Field(ge=1)], Annotated[int, Field(ge=2)]]] = (
        Field(description="each run of `spans`, in order: its trace id, how many records, "
                          "and their bytes in the frame (the records' JSON, comma-joined)")
    )
    spans: list[dict[str, object]]
    # The frame's body, where framing.span_batch_of wrote it with the batch: sent as it is.
    # No default: a default is copied into each batch made (~1.5 us a batch, the runner's).
    _written: bytes


class TraceSpans(NamedTuple):
    """A run of span records of one trace as JSON: `body` is the records comma-joined (a JSON
    array's contents, no brackets), `count` how many. How a worker carries its runner's spans
    to `fleet.traces.<trace_id>`, never parsed on the way (fleet/trace/nats_export.py)."""

    trace_id: str
    count: int
    body: bytes


RunnerReport = Annotated[
    RunnerStatusReport
    | TaskAccepted
    | TokenChunk
    | ToolCallChunk
    | ImageChunk
    | EmbeddingChunk
    | ErrorChunk
    | TaskFinished
    | SpanBatch,
    Field(discriminator="type"),
]

COMMAND = TypeAdapter(RunnerCommand)
REPORT = TypeAdapter(RunnerReport)
