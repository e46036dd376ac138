"""Runner states, one class per state, as kept in FLEET_RUNNERS and sent on the worker pipe."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fleet.wire.base import Part


class RunnerIdle(Part):
    state: Literal["idle"] = "idle"


class RunnerDownloading(Part):
    """The node is fetching the model's files from FLEET_WEIGHTS; no runner process yet."""

    state: Literal["downloading"] = "downloading"
    bytes_done: int = 0
    bytes_total: int = 0


class RunnerConnecting(Part):
    state: Literal["connecting"] = "connecting"


class RunnerConnected(Part):
    state: Literal["connected"] = "connected"


class RunnerLoading(Part):
    state: Literal["loading"] = "loading"
    layers_done: int = 0
    layers_total: int = 0


class RunnerLoaded(Part):
    state: Literal["loaded"] = "loaded"


class RunnerWarmingUp(Part):
    state: Literal["warming_up"] = "warming_up"


class RunnerReady(Part):
    state: Literal["ready"] = "ready"


class RunnerRunning(Part):
    state: Literal["running"] = "running"
    active_tasks: int = 1


class RunnerShuttingDown(Part):
    state: Literal["shutting_down"] = "shutting_down"


class RunnerShutdown(Part):
    state: Literal["shutdown"] = "shutdown"


class RunnerFailed(Part):
    state: Literal["failed"] = "failed"
    error: str


RunnerStatus = Annotated[
    RunnerIdle
    | RunnerDownloading
    | RunnerConnecting
    | RunnerConnected
    | RunnerLoading
    | RunnerLoaded
    | RunnerWarmingUp
    | RunnerReady
    | RunnerRunning
    | RunnerShuttingDown
    | RunnerShutdown
    | RunnerFailed,
    Field(discriminator="state"),
]

ACCEPTS_TASKS = ("ready", "running")
