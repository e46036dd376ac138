"""The seam between the runner's state machine and a model: text (mlx-lm) or image (mflux).

The runner owns one engine and drives it from one thread: load, warm up, then repeatedly
admit new tasks and call `step()`, which advances every admitted task by one unit of work
(one decode step for text, one image for images) and returns the wire events it produced.
Only `cancel` may be called from another thread: it records the id and the engine ends the
task at its next step (or diffusion step) with a `cancelled` TaskFinished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from fleet.wire.cluster import ModelCard
from fleet.wire.events import OutputEvent, TokenChunk
from fleet.wire.tasks import Task

Progress = Callable[[int, int], None]  # (layers_done, layers_total)


class GroupLost(Exception):
    """A sharded instance's group broke (a peer left the ring): the runner exits as crashed,
    and its worker ends or continues the tasks in flight as after any runner crash."""


class Token(NamedTuple):
    """One token without logprobs, as an engine makes it: what a TokenChunk of one token says,
    without the model. At full rate a TokenChunk built per token was a fifth of the runner's
    CPU (pydantic validation, ~2 us against ~0.25 us for this); the runner's coalescer turns
    these into token events (fleet.wire.token_frames.token_event), and `chunk()` is the model,
    field for field. A token with logprobs is a TokenChunk from the start."""

    task_id: str
    at: float
    index: int
    token_id: int
    text: str

    @property
    def type(self) -> str:  # as every report's: what logs and tests tell reports apart by
        return "token"

    def chunk(self) -> TokenChunk:
        return TokenChunk(task_id=self.task_id, at=self.at, index=self.index,
                          token_id=self.token_id, text=self.text)


EngineEvent = OutputEvent | Token  # what a step returns


@dataclass(frozen=True)
class EngineConfig:
    card: ModelCard
    model_path: Path
    slots: int
    images_dir: Path  # the node's image cache: inputs are read from and outputs written here
    node_id: str = "local"
    runner_id: str = "runner"
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    """A task handed to the engine, with what the worker learned before dispatching it."""

    task: Task
    inputs: dict[str, Path] = field(default_factory=dict)  # sha256 -> verified local file
    queue_wait_s: float = 0.0
    # A continued text task: the completion tokens its earlier attempts streamed, in order.
    generated: tuple[int, ...] = ()
    # A restarted image task: the images and previews its earlier attempts delivered, as
    # "<image>.<preview>" / "<image>.final"; they are not announced again.
    delivered_images: frozenset[str] = frozenset()
    # The task's trace context, for a sharded instance's other ranks to trace their share.
    traceparent: str | None = None
    tracestate: str | None = None


@runtime_checkable
class Wakeable(Protocol):
    """An engine that can idle inside `step()` with nothing to compute (the fault engine's
    paced wait): `wake` ends that idling when a command arrives, as a real engine's next
    step would admit it. Engines whose step is real work do not implement it."""

    def wake(self) -> None:
        """Thread-safe: a command for the engine's thread is waiting."""
        ...


class Engine(Protocol):
    def load(self, progress: Progress) -> None: ...

    def warm_up(self) -> None: ...

    def admit(self, admission: Admission) -> None:
        """Start a task (raise TaskRejected to refuse it); it runs on later `step()` calls."""
        ...

    def step(self) -> Sequence[EngineEvent]:
        """Advance all admitted tasks; each ends with exactly one TaskFinished."""
        ...

    def cancel(self, task_id: str) -> None:
        """Thread-safe: end the task at the next step with status cancelled."""
        ...

    @property
    def active(self) -> int: ...

    def close(self) -> None: ...
