"""A sharded instance's runner group: what each rank is told, and what rank 0 sends the other
ranks over the ring (mx.distributed) before every engine step."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.wire.base import Part, Wire
from fleet.wire.tasks import TextGeneration

# A rank whose group broke (a peer rank's process or node died) exits with this. Its worker
# sees a crash that is no fault of the tasks in flight: one not yet streaming is continued
# from its first token like one that was, not ended `runner_crashed`.
RING_LOST_EXIT = 3


class GroupSpec(Part):
    """This runner's place in a pipeline: its rank, its layers, every rank's ring address."""

    rank: int = Field(ge=0)
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)
    ring: list[str] = Field(min_length=2, description="host:port of each rank, by rank")
    connect_timeout_s: float = Field(
        default=60.0, gt=0, description="how long the ring may take to form before the runner "
        "fails, naming the ranks that never came",
    )

    @property
    def world_size(self) -> int:
        return len(self.ring)


class PlannedAdmission(Part):
    """A task rank 0 admitted; every other rank admits the same, at the same step."""

    task: TextGeneration
    generated: list[int] = Field(default_factory=list)
    queue_wait_s: float = 0.0
    traceparent: str | None = None
    tracestate: str | None = None


class StepPlan(Wire):
    """Rank 0's decisions for the next step, applied by every rank before it steps: so each
    rank's batch changes at the same step and their pipeline sends and receives pair up."""

    type: Literal["step_plan"] = "step_plan"
    admit: list[PlannedAdmission] = Field(default_factory=list)
    cancel: list[str] = Field(default_factory=list)
    stop: bool = Field(default=False, description="the group shuts down: no step follows")
