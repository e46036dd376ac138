"""The worker <-> runner pipe: typed messages, framed as 4-byte big-endian length + JSON.

Commands flow worker -> runner (imperative names); reports flow runner -> worker. Task
output uses the very wire events published on `fleet.out.<task_id>`.
"""

from __future__ import annotations

from typing import Annotated, Literal

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


class SpanBatch(Wire):
    """Finished OpenTelemetry spans from the runner, exported by the worker."""

    type: Literal["spans"] = "spans"
    spans: list[dict[str, object]]


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
