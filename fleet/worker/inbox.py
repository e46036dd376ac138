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
from opentelemetry.trace import Span

from fleet.wire.events import ErrorReason, ImageChunk
from fleet.wire.handoff import TaskHandOff
from fleet.wire.pipe import RunnerReport
from fleet.wire.token_frames import TokenFrame
from fleet.worker.continuation import Continue
from fleet.worker.intake import Queued, Settled
from fleet.worker.state import PendingTask, StateEvent


@dataclass(frozen=True)
class Fetched:
    """The answer to one pull: possibly no messages at all."""

    model: str
    msgs: list[Msg]
    drained: bool = False  # fewer came back than it asked for: the queue had no more


@dataclass(frozen=True)
class Tick:
    """Time to plan again (deadlines pass without any other news); the in_progress beats of
    held messages have a timer of their own (fleet.worker.acks.beat_forever)."""


@dataclass(frozen=True)
class TakenIn:
    """A message's intake (a child) answered: `outcome` (Queued or Settled), or `error` when
    it could not decide (given back for another try)."""

    key: str  # the intake key it was held under (fleet.worker.acks.intake_key)
    msg: Msg
    outcome: Queued | Settled | None
    span: Span  # the message's span (fleet.worker.spans), ended with its outcome
    handed_in: bool = False
    error: str | None = None


@dataclass(frozen=True)
class CrashJudged:
    """A task whose runner exited under it, after a child read what it had streamed:
    `decided` is a Continue (back in the queue) or None (it ends runner_crashed)."""

    task_id: str
    exited: RunnerExited
    pending: PendingTask
    decided: Continue | None


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
    """One report a runner wrote on its pipe; a token event as its bytes (TokenFrame), which
    the worker publishes unchanged. A terminal's `tail`: its task's token events read with it,
    just before it (fleet.worker.tails), stored inside it or, where it is not stored, before
    the rest of its handling."""

    runner_id: str
    report: RunnerReport | TokenFrame
    tail: tuple[TokenFrame, ...] = ()


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
class Fenced:
    """The stream refused an event of this task: another attempt has taken it over
    (fleet.worker.takeover), so this node gives it up."""

    task_id: str


@dataclass(frozen=True)
class Stop:
    """End the loop and shut down cleanly."""


InboxItem = (
    Fetched | Tick | TakenIn | CrashJudged | InputsFetched | InputsFailed | CancelSeen
    | RunnerReported | RunnerExited | ImageUploaded | HandedIn | Fenced | Stop | StateEvent
)

Inbox = asyncio.Queue[InboxItem]
