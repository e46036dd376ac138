"""What arrives in the worker's inbox besides state events and runner reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nats.aio.msg import Msg

from fleet.wire.events import ErrorReason


@dataclass(frozen=True)
class Fetched:
    """The answer to one pull: possibly no messages at all."""

    model: str
    msgs: list[Msg]


@dataclass(frozen=True)
class Tick:
    """Time for in-progress heartbeats of running tasks."""


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
class Stop:
    """End the loop and shut down cleanly."""
