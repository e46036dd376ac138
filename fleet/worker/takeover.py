"""Taking over a task whose worker is gone, and fencing the worker that was only paused.

A worker holds a task message with in_progress beats every AckWait/4 (fleet.worker.acks).
When it dies, the death watch sees its connection gone within a second or two and naks the
message (fleet.worker.deathwatch), so JetStream hands it to another worker at once; a worker
paused or cut off with its connection open (SIGSTOP, a frozen VM, a partition) keeps it until
AckWait (30 s by default) runs out, and when it resumes it still believes it runs the task.
Either verdict may be wrong, so the takeover is made safe on the write path, not by guessing
who is dead:

- Every event a worker writes on `fleet.out.<task_id>` carries
  `Nats-Expected-Last-Subject-Sequence: <fence>` for the subject `fleet.out.<task_id>.fence`
  (`fence_headers`). The first attempt's fence is 0: "no takeover yet".
- A worker that receives a task message again (delivery > 1, handed in by another node, or
  a first delivery whose task-id claim was already its own, `takes_fence`) first writes a
  TaskFence on that subject, compare-and-set on the last one it read (`take_fence`), and
  only then reads back what was stored and writes anything. From the fence's sequence on,
  the stream refuses every event of an older attempt (JetStream error 10071, wrong last
  sequence): what the new attempt read back is exactly what the old one got stored, so the
  stored stream has no gap and no duplicate.
- A worker whose write is refused that way has lost the task: it gives it up (`fenced_fate`)
  without a terminal and without a JetStream verb (the message belongs to the new holder).

Who may take over (`may_take_over`): only a newer delivery than the fence's. A paused
worker's pending pull can be handed a redelivery while it is stopped; when it resumes, that
delivery is already older than the one another worker took the task over with, so it takes
nothing and settles nothing (`Superseded`): the message is the newer holder's. Two workers
that take the fence at once: the compare-and-set lets one write at a time, and the later fence
wins (the earlier taker is refused like any older attempt).

A redelivery is not always a lost holder: a consumer whose leader changes can redeliver a
message its holder took seconds before and still beats (seen when a paused server returned
and forced elections; nats-server PR #6469). So a worker handed a redelivery that another
node holds (the last fence's node, else the node of the task's first accept: `holder_of`)
first probes that node's `fleet.alive.<node>` (`redelivery_fate`): alive, it passes the
delivery to it as a hand-off (fleet.worker.handoff), and the holder, which still holds that
stream message, keeps it renewed under the newest delivery; nothing runs twice. Dead
(no responders) or silent (paused, cut off) it takes the task over with the fence as above.
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum

from nats.js import JetStreamContext
from nats.js.errors import APIError

from fleet.bus.task_log import EXPECTED_LAST_SUBJECT_SEQ, TaskLog, fence_subject
from fleet.wire.events import TaskAccepted, TaskFence
from fleet.worker.deathwatch import Probe

log = logging.getLogger(__name__)

EXPECTED_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for a failed expected-sequence check
FENCE_TRIES = 5


class TaskFenced(Exception):
    """Another attempt has taken this task over: this worker may write nothing more on it."""


class Superseded(Exception):
    """This delivery is older than the one the task was last taken over with."""


def fence_headers(task_id: str, fence: int) -> dict[str, str]:
    """Pure. The headers that make the stream refuse an event once a newer fence exists."""
    return {EXPECTED_LAST_SUBJECT_SEQ: str(fence), EXPECTED_SUBJECT: fence_subject(task_id)}


def is_fenced(exc: BaseException) -> bool:
    """An expected-sequence refusal: the only one Fleet's events can get is the fence's."""
    return isinstance(exc, APIError) and getattr(exc, "err_code", None) == WRONG_LAST_SEQUENCE


def may_take_over(
    delivery: int, node_id: str, last: TaskFence | None, *, handed_in: bool = False
) -> bool:
    """Pure. A delivery may fence the task only if it is newer than the last fence's, or is
    that fence's own delivery on the same node (a retried write of it), or was handed in by
    the node that holds that delivery (it gave the task up to this one)."""
    if last is None or delivery > last.delivery:
        return True
    if delivery == last.delivery:
        return handed_in or node_id == last.node_id
    return False


def takes_fence(delivery: int, *, handed_in: bool = False, claimed_before: bool = False) -> bool:
    """Pure. Who must take a task over before writing: a message delivered again (its earlier
    holder stopped beating, or gave it back, and may still be alive), or handed in by another
    node (whose runner may have streamed part of it before it crashed there). A first
    delivery taken from the stream writes under fence 0, which any takeover refuses.

    `claimed_before`: the task id's claim was already this message's (fleet.worker.claims,
    OWN), so an earlier delivery of it reached a worker although the count says 1: a server
    killed and restarted on its store forgets its consumers' last deliveries (their state
    is written behind the messages) and delivers a held message again as a first delivery.
    On another node than its holder's that ran the task twice, both under fence 0 and the
    same Msg-Ids: the copies JetStream did not dedupe (tokens batched otherwise) were stored
    twice (CI, the full-rate restart fault test). A create retried after a lost answer also
    finds its own claim: then nobody holds it and the fence costs one write."""
    return delivery > 1 or handed_in or claimed_before


def holder_of(fence: TaskFence | None, accepted: TaskAccepted | None) -> str | None:
    """Pure. The node that holds a task's message as far as its output says: the last taker
    (every takeover and hand-in writes a fence), else the node that accepted it first; None
    when neither is stored (it was never dispatched: nobody to ask)."""
    if fence is not None:
        return fence.node_id
    return accepted.node_id if accepted is not None else None


def holder_to_ask(delivery: int, node_id: str, holder: str | None, *,
                  handed_in: bool = False, claimed_before: bool = False) -> str | None:
    """Pure. The other node to probe before this delivery takes the task over: only for a
    redelivery pulled from the stream (a hand-in was given up by its sender) of a task
    another node took, a first delivery whose claim was already its own included
    (`takes_fence`); None: take it over at once."""
    if handed_in or not takes_fence(delivery, claimed_before=claimed_before):
        return None
    if holder is None or holder == node_id:
        return None
    return holder


class RedeliveryFate(StrEnum):
    """What a worker does with a redelivery of a task another node took."""

    PASS_TO_HOLDER = "pass_to_holder"  # the holder lives: it keeps the message, renewed
    TAKE_OVER = "take_over"  # dead or silent: fence it and continue it here


def redelivery_fate(probe: Probe) -> RedeliveryFate:
    """Pure. Only an answer passes the delivery on: a silent holder may be paused past its
    AckWait (a SIGSTOPped worker), and the fence makes taking over from it safe."""
    if probe is Probe.ANSWERED:
        return RedeliveryFate.PASS_TO_HOLDER
    return RedeliveryFate.TAKE_OVER


class FencedFate(StrEnum):
    """What a worker does with a task another attempt took over (it writes nothing more)."""

    CANCEL_RUNNER = "cancel_runner"  # stop generating; its terminal is dropped, not stored
    RELEASE = "release"  # not on a runner yet: drop it from the queue
    IGNORE = "ignore"  # already ending or gone here: its ending gives it up itself


def fenced_fate(*, in_flight: bool, pending: bool) -> FencedFate:
    """Pure. On a runner wins: it is still generating and must stop."""
    if in_flight:
        return FencedFate.CANCEL_RUNNER
    return FencedFate.RELEASE if pending else FencedFate.IGNORE


async def take_fence(
    js: JetStreamContext, task_id: str, node_id: str, delivery: int, *, handed_in: bool = False
) -> tuple[int, TaskFence | None]:
    """Write a new fence for `task_id`; its stream sequence (this attempt's fence) and the
    fence it replaced (None when the task had none). Compare-and-set on the last fence:
    a fence written meanwhile by another taker is read again and replaced."""
    log_ = TaskLog.of(js)
    for _ in range(FENCE_TRIES):
        last_seq, last = await log_.last_fence(task_id)
        if not may_take_over(delivery, node_id, last, handed_in=handed_in):
            raise Superseded(
                f"task {task_id}: delivery {delivery} is older than delivery "
                f"{last.delivery if last else '?'}, which took it over on node "
                f"{last.node_id if last else '?'}"
            )
        fence = TaskFence(
            task_id=task_id, attempt=(last.attempt + 1) if last else 1, node_id=node_id,
            delivery=delivery, at=time.time(),
        )
        try:
            seq = await log_.put_fence(fence, last_seq)
        except APIError as exc:
            if is_fenced(exc):
                continue  # another taker wrote one after our read: read it and go on top
            raise
        log.info("task %s taken over (fence %d, attempt %d, delivery %d)", task_id, seq,
                 fence.attempt, delivery)
        return seq, last
    raise TaskFenced(f"task {task_id}: the fence kept moving under {FENCE_TRIES} tries")
