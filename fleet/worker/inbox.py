"""Everything that reaches the worker's loop, as one union: `InboxItem`.

The loop is the only consumer; every child of the worker (pulls, input fetches, image
uploads, runner pumps, the cancel listener, the tick, the cluster link) talks to it only by
putting one of these into `Inbox`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from nats.aio.msg import Msg

from fleet.wire.events import ErrorReason, ImageChunk
from fleet.wire.handoff import TaskHandOff
from fleet.wire.pipe import RunnerReport
from fleet.worker.state import StateEvent


@dataclass(frozen=True)
class Fetched:
    """The answer to one pull: possibly no messages at all."""

    model: str
    msgs: list[Msg]


@dataclass(frozen=True)
class Tick:
    """Time for in-progress heartbeats of held task messages."""


@dataclass(frozen=True)
class InputsFetched:
    task_id: str
    paths: dict[str, Path]


@dataclass(frozen=True)
class InputsFailed:
    task_id: str
    reason: ErrorReason
    message: str


@dataclass(frozen=True)
class CancelSeen:
    task_id: str


@dataclass(frozen=True)
class RunnerReported:
    """One report a runner wrote on its pipe."""

    runner_id: str
    report: RunnerReport


@dataclass(frozen=True)
class RunnerExited:
    """The last item about a runner: its process is gone (nothing more comes from it)."""

    runner_id: str
    returncode: int
    how: str = ""  # "exited with code 1", "killed by SIGKILL"


@dataclass(frozen=True)
class ImageUploaded:
    """An output image's upload ended: stored, or `error` says why not."""

    runner_id: str
    image: ImageChunk
    error: str | None = None


@dataclass(frozen=True)
class HandedIn:
    """Another node's worker offers this node a task message it holds; answer on `reply`."""

    hand_off: TaskHandOff
    reply: str
    received_at: float  # monotonic: an offer the loop reaches too late is declined


@dataclass(frozen=True)
class Stop:
    """End the loop and shut down cleanly."""


InboxItem = (
    Fetched | Tick | InputsFetched | InputsFailed | CancelSeen | RunnerReported | RunnerExited
    | ImageUploaded | HandedIn | Stop | StateEvent
)

Inbox = asyncio.Queue[InboxItem]
