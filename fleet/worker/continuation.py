"""Continuing a text task whose worker died after its output began.

FLEET_OUT holds every event the dead attempt published, in order, each token with its index
and token id. A redelivered task's stored stream is read back, and `decide` (pure) says what
to do: continue from the next index with the generated token ids (the runner prefills prompt
+ generated and resumes sampling, penalties and grammar there), or give up (`worker_lost`)
when the stream cannot be continued exactly or the task used up its `max_continuations`.

Only the contiguous run of tokens from index 0 counts as generated: a client reading
FLEET_OUT sees the stream in index order (fleet.bus.task_log), so what it has seen is exactly
that run, and the next attempt's first token takes the next index. Tokens the dead attempt
stored beyond a hole in that run (a message lost in a leader change while later ones were
stored, and the fence refused its re-send) are superseded: this attempt makes those indexes
again, under Msg-Ids of its own (fleet.worker.outputs.event_msg_id), and readers drop the old
copies at this attempt's task_accepted. The dead attempt's late events are refused by the fence
(fleet.worker.takeover), so nothing is stored twice by two live attempts.

A sampled task draws token i from a key that is a pure function of (seed, i)
(fleet.runner.sampling), so it continues exactly only with the seed its first attempt used: a
task sent without one gets one fixed by the worker at its first dispatch (`with_seed`), the
runner records it in the attempt's `task_accepted`, and `decide` hands it to every
continuation.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from enum import StrEnum

from nats.aio.client import Client
from nats.js import JetStreamContext

from fleet.bus.task_log import TaskLog
from fleet.wire.events import (
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.ring import RING_LOST_EXIT
from fleet.wire.tasks import Task, TextGeneration
from fleet.worker.state import PendingTask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continue:
    generated: tuple[int, ...]  # token ids of indexes 0..k-1; the next attempt emits index k
    attempt: int  # 1 for the first continuation
    delivered_images: frozenset[str] = frozenset()  # an image task: "<i>.<preview>", "<i>.final"
    seed: int | None = None  # the seed the first attempt sampled with (recorded in its accept)
    moved_from: str | None = None  # the node the previous attempt ran on (its accept says)


@dataclass(frozen=True)
class GiveUp:
    message: str


def decide(task: Task, events: list[OutputEvent]) -> Continue | GiveUp | None:
    """What a redelivered task with stored output needs. None: it has finished already."""
    if any(isinstance(event, TaskFinished) for event in events):
        return None
    images = [event for event in events if isinstance(event, ImageChunk)]
    if isinstance(task, TextGeneration) and images:
        return GiveUp("image output cannot be continued by a text task")
    # Each attempt is accepted once, marked with its number (0 for the first run).
    continuations = max((e.attempt for e in events if isinstance(e, TaskAccepted)), default=0)
    if continuations >= task.max_continuations:
        return GiveUp(
            f"the worker running this task was lost after output had started, and it was "
            f"continued {continuations} times already (max_continuations "
            f"{task.max_continuations})"
        )
    if not isinstance(task, TextGeneration):
        # An image task restarts from step 0 with the same seeds (the same bytes) and skips
        # what was delivered.
        return Continue((), continuations + 1, frozenset(map(image_key, images)),
                        moved_from=previous_node(events))
    return Continue(
        generated=generated_tokens(events), attempt=continuations + 1, seed=recorded_seed(events),
        moved_from=previous_node(events),
    )


def previous_node(events: list[OutputEvent]) -> str | None:
    """The node the latest attempt was accepted on (the one a continuation moves from)."""
    return next((e.node_id for e in reversed(events) if isinstance(e, TaskAccepted)), None)


def recorded_seed(events: list[OutputEvent]) -> int | None:
    """The seed an earlier attempt recorded in its task_accepted (the first one that did)."""
    return next((e.seed for e in events if isinstance(e, TaskAccepted) and e.seed is not None),
                None)


def with_seed(task: Task, recorded: int | None) -> Task:
    """The task as dispatched: a sampled text task without a seed samples with the one its
    first attempt recorded, or, on a first attempt, with a fresh one fixed here (the runner
    records it), so that a continuation can draw the same tokens."""
    if not isinstance(task, TextGeneration) or task.seed is not None or task.temperature == 0.0:
        return task
    seed = recorded if recorded is not None else secrets.randbits(63)
    return task.model_copy(update={"seed": seed})


def image_key(event: ImageChunk) -> str:
    partial = "final" if event.partial_index is None else event.partial_index
    return f"{event.image_index}.{partial}"


def output_began(last: OutputEvent | None) -> bool:
    """Whether a task's newest stored event shows that output went out: a streamed event, or
    the acceptance of a continuation (killed again before its first new event)."""
    return isinstance(last, TokenChunk | ToolCallChunk | ImageChunk) or (
        isinstance(last, TaskAccepted) and last.attempt > 0
    )


def exit_continues_all(returncode: int) -> bool:
    """Pure. Whether a runner's exit continues every task it had in flight, streaming or not:
    a rank whose group's ring broke (`RING_LOST_EXIT`: a peer's death, no fault of the
    tasks). After any other crash a task that had not streamed ends `runner_crashed`: it may
    have crashed the runner itself, and rerun it could crash the next one too."""
    return returncode == RING_LOST_EXIT


def generated_tokens(events: list[OutputEvent]) -> tuple[int, ...]:
    """The token ids of the contiguous run of indexes from 0 (what a reader has seen)."""
    by_index: dict[int, int] = {}
    for event in events:
        if isinstance(event, TokenChunk):  # an event may carry several tokens
            for offset, token in enumerate(event.ids):
                by_index.setdefault(event.index + offset, token)
    tokens: list[int] = []
    while len(tokens) in by_index:
        tokens.append(by_index[len(tokens)])
    return tuple(tokens)


NOT_CONTINUED = Continue((), 0)


class CrashFate(StrEnum):
    """What becomes of a task in flight on a runner that exited."""

    ENDING = "ending"  # its terminal came and waits behind an image upload: it still ends so
    READ_BACK = "read_back"  # its message is held here: read back what it streamed, and decide
    CRASHED = "crashed"  # it ends runner_crashed now


def crash_fate(*, terminal_waiting: bool, held_for_continuation: bool) -> CrashFate:
    """Pure. A terminal already reported wins over a continuation: restarting a task whose
    runner had finished it would run it on while its old terminal acks it, once its images
    are stored (the race issue 27 suspected)."""
    if terminal_waiting:
        return CrashFate.ENDING
    return CrashFate.READ_BACK if held_for_continuation else CrashFate.CRASHED


class CrashRoute(StrEnum):
    """Where a task cut short by its runner's crash continues."""

    HERE = "here"  # on a ready runner of this node, or the restarted one once it is ready
    HAND_BACK = "hand_back"  # nak now: a ready runner of another node takes it over at once


def crash_route(*, text: bool, runner_ready_here: bool) -> CrashRoute:
    """Pure. A text task whose runner died while no other runner of its model is ready here
    goes back to the stream at once instead of waiting for the restart and model load (seconds
    to minutes): a worker with a free slot takes it over (its intake fences the task and
    continues from the stored tokens); if none has one, it comes back here when the restarted
    runner asks for work. An image task stays: its images may still be uploading from here."""
    return CrashRoute.HAND_BACK if text and not runner_ready_here else CrashRoute.HERE


class ContinuationBook:
    """The worker's notes for continuing tasks: what a continued task's next dispatch must
    carry, and each running task (its message is held here), so that a runner crash can put
    it back in the queue instead of ending it."""

    def __init__(self) -> None:
        self.queued: dict[str, Continue] = {}
        self.running: dict[str, PendingTask] = {}
        self.seams: dict[str, Continue] = {}  # a continued task on a runner: where it resumed

    def dispatched(self, pending: PendingTask) -> Continue:
        """What the SubmitTask of a task being dispatched now carries of its earlier attempts
        (nothing, attempt 0, for a first run)."""
        task_id = pending.task.task_id
        self.running[task_id] = pending
        earlier = self.queued.pop(task_id, None) or NOT_CONTINUED
        if earlier.attempt:
            self.seams[task_id] = earlier
        return earlier

    def released(self, task_id: str) -> None:
        self.queued.pop(task_id, None)
        self.running.pop(task_id, None)
        self.seams.pop(task_id, None)


async def stored_events(nc: Client, js: JetStreamContext, task_id: str) -> list[OutputEvent]:
    """Every event stored for a task in FLEET_OUT, in index order (fleet.bus.task_log): the
    earlier attempt's tokens behind a hole that a later continuation resumed at are left out,
    so a second continuation builds on the tokens a client has seen, not on superseded ones."""
    return await TaskLog(nc, js).read(task_id)
