"""What happens to a task message the moment it is fetched: decode, claim its id, and the
checks that can end it before it ever reaches a runner (bad bytes, an id that is not its own,
redelivery, early cancel, deadline).

The intake runs in a child of the worker's Supervisor, never in its loop: its claim, cancel
lookup and read-backs may each wait out a broker election. It decides; it never sends a
JetStream verb itself. Its outcome is a stage of the ack policy (`Settled.stage`,
fleet.worker.acks), and the worker's loop settles the message by it. Every event the intake
writes on `fleet.out.<id>` comes after this message has claimed that id
(fleet.worker.claims): a message that does not own its id writes nothing there. A message
delivered again takes the task over (its fence, fleet.worker.takeover) before it reads back
what an earlier attempt stored.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.bus.task_log import TaskLog
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event, decode_task, sent_task_id
from fleet.wire.events import (
    ErrorReason,
    ImageChunk,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.tasks import Task, is_past
from fleet.worker.acks import Stage
from fleet.worker.claims import AHEAD_KEPT, Claim, Claims, owner_of
from fleet.worker.cluster import ClusterLink
from fleet.worker.continuation import (
    ContinuationBook,
    Continue,
    GiveUp,
    decide,
    output_began,
    stored_events,
)
from fleet.worker.deathwatch import probe
from fleet.worker.outputs import TaskOutput
from fleet.worker.prefix_blocks import prompt_blocks
from fleet.worker.state import PendingTask
from fleet.worker.takeover import (
    RedeliveryFate,
    Superseded,
    holder_of,
    holder_to_ask,
    redelivery_fate,
    takes_fence,
)

log = logging.getLogger(__name__)

STREAMED = (TokenChunk, ToolCallChunk, ImageChunk)
ACCEPT_WITHIN = 4  # a task's accept is its first event; a few stored before it are tolerated

@dataclass(frozen=True)
class Queued:
    pending: PendingTask


@dataclass(frozen=True)
class Settled:
    """The message needs no runner: `stage` says what it gets now (an ack once its terminal
    is stored, or a redelivery of a finished task; a term for poison and refused messages).
    `task_id` is the id this message owns; None when it owns none (refused, or no usable id),
    so nothing keyed by that id, such as the owner's held message, may be touched for it."""

    task_id: str | None
    reason: str
    stage: Stage = Stage.FINISHED_STORED
    # A redelivery of a finished task: the terminal an earlier attempt stored, whose fair
    # charge (fleet.worker.fair_charge) is made before this message's ack if it was not.
    finished: TaskFinished | None = None


class Intake:
    def __init__(
        self, js: JetStreamContext, output: TaskOutput, cluster: ClusterLink,
        claims: Claims | None = None,
    ) -> None:
        """`claims`: the FLEET_CLAIMS handle; opened on first use when not given."""
        self.js = js
        self.output = output
        self.cluster = cluster
        self.claims = claims
        self.book = ContinuationBook()
        # Tasks decoded by `ahead`, by their message's ack subject (one a delivery).
        self._decoded: OrderedDict[str, Task] = OrderedDict()

    async def ahead(self, msgs: list[Msg]) -> None:
        """Freshly fetched messages: decode each and send its claim now (Claims.ahead), before
        the worker's loop takes them in; `receive` reads both. A message that does not decode
        is left to `receive` whole (it claims what it can). Their listing in this node's
        heartbeat is sent after them (Heartbeat.list_ahead): its put goes out with the
        claims. Never raises."""
        try:
            claims = await self._claims()
        except Exception as exc:  # `receive` opens them again, and says so if it fails
            log.debug("claims not sent ahead: %r", exc)
        else:
            for msg in msgs:
                try:
                    task = decode_task(msg.data)
                except DecodeError:
                    continue
                if msg.reply:
                    self._decoded[msg.reply] = task
                    while len(self._decoded) > AHEAD_KEPT:
                        self._decoded.popitem(last=False)
                await claims.ahead(task.task_id, owner_of(msg))
        await self.cluster.heartbeat.list_ahead([msg.reply for msg in msgs])

    async def receive(self, msg: Msg, *, handed_in: bool = False) -> Queued | Settled:
        """`handed_in`: another node passed this message on (fleet.worker.handoff), perhaps
        after its runner had streamed part of the answer: taken over like a redelivery."""
        self.cluster.heartbeat.taken_in(msg.reply)  # held by the loop from here on
        delivery = msg.metadata.num_delivered if msg.metadata else 1
        try:
            task = self._decoded.pop(msg.reply, None) if msg.reply else None
            task = task or decode_task(msg.data)
        except DecodeError as exc:
            return await self._invalid(msg, exc.task_id, str(exc))
        model = subjects.model_of_task_subject(msg.subject)
        if task.model != model:
            return await self._invalid(
                msg, task.task_id, f"task names model {task.model!r} but was sent to {msg.subject}"
            )
        claim = await self._claim(msg, task.task_id)
        if isinstance(claim, Settled):
            return claim
        # An earlier delivery of this message claimed the id: delivered again, whatever the
        # count says (a server restarted on its store: fleet.worker.takeover.takes_fence).
        before = claim is Claim.OWN
        if before and delivery <= 1 and not handed_in:
            log.warning("task %s: a first delivery of a message that claimed it before (its "
                        "server forgot a delivery): handled as a redelivery", task.task_id)
        if (passed := await self._pass_to_holder(msg, task.task_id, delivery, handed_in,
                                                 before)):
            return passed
        if takes_over := takes_fence(delivery, handed_in=handed_in, claimed_before=before):
            # Before anything is read back or written: from here on an earlier holder that
            # was only paused can store nothing more on this task (fleet.worker.takeover).
            try:
                await self.output.take_over(task.task_id, self.cluster.node_id, delivery,
                                            handed_in=handed_in)
            except Superseded as exc:  # no verb, no write: the message is a newer holder's
                log.warning("%s: this delivery is dropped", exc)
                return Settled(None, "superseded", Stage.SUPERSEDED)
        if takes_over and (settled := await self._redelivered(task)):
            if settled.stage is Stage.REDELIVERED_FINISHED:
                self.output.forget(task.task_id)  # its fence: nothing more is written here
            return settled
        if await self.cluster.is_cancelled(task.task_id):
            return await self._end(task.task_id, ErrorReason.CANCELLED, "cancelled early")
        if is_past(task.deadline, datetime.now(UTC)):
            if (earlier := self.book.queued.pop(task.task_id, None)) is not None:
                # Its worker was lost after output began, and the deadline has passed: not
                # run again past it (a deadline is when to have started); what streamed stays.
                return await self._end(
                    task.task_id, ErrorReason.DEADLINE, "the deadline passed while it was "
                    f"being continued: its {len(earlier.generated)} streamed tokens are kept")
            return await self._end(
                task.task_id, ErrorReason.DEADLINE, "the deadline passed before it started"
            )
        hashes = task.image_hashes()
        card = self.cluster.cards.get(model)
        if hashes and card is not None and not card.is_image and "vision" not in card.capabilities:
            return await self._end(
                task.task_id, ErrorReason.UNSUPPORTED,
                f"model {model!r} reads text only; the task carries images",
            )
        return Queued(PendingTask(
            task=task, received_at=time.time(), delivery=delivery,
            inputs=None if hashes else {}, blocks=prompt_blocks(task),
        ))

    async def _claims(self) -> Claims:
        if self.claims is None:
            self.claims = await Claims.open(self.output.nc, self.js)
        return self.claims

    async def _claim(self, msg: Msg, task_id: str) -> Settled | Claim:
        """The claim when this message owns `task_id` (FRESH, or OWN: claimed by an earlier
        delivery of it); else it is refused, and termed."""
        claims = await self._claims()
        claim, reason = await claims.admit_claim(task_id, owner_of(msg))
        if reason is None:
            return claim
        model = subjects.model_of_task_subject(msg.subject)
        await claims.refuse(msg, model, task_id, reason)
        return Settled(None, reason, Stage.INVALID)

    async def _invalid(self, msg: Msg, task_id: str | None, message: str) -> Settled:
        log.warning("invalid task on %s (%s): %s", msg.subject, task_id or "no id", message)
        if task_id is None:  # no id it could own: answer the publisher, write on no task
            claims = await self._claims()
            model = subjects.model_of_task_subject(msg.subject)
            await claims.refuse(msg, model, sent_task_id(msg.data), "invalid_task_id", message)
            return Settled(None, "invalid_task", Stage.INVALID)
        if isinstance(refused := await self._claim(msg, task_id), Settled):
            return refused
        await self.output.fail(task_id, ErrorReason.INVALID_TASK, message)
        return Settled(task_id, "invalid_task", Stage.INVALID)  # poison: never redeliver

    async def _end(self, task_id: str, reason: ErrorReason, message: str) -> Settled:
        self.book.released(task_id)
        await self.output.fail(task_id, reason, message, node_id=self.cluster.node_id)
        return Settled(task_id, reason.value)

    async def _pass_to_holder(
        self, msg: Msg, task_id: str, delivery: int, handed_in: bool, claimed_before: bool
    ) -> Settled | None:
        """A redelivery of a task another node took: passed to that node when it answers
        alive (it still holds the message and keeps it, renewed: fleet.worker.takeover);
        None to take it over here (the holder is dead, silent, or declined it)."""
        if handed_in or not takes_fence(delivery, claimed_before=claimed_before):
            return None  # read nothing for the first delivery
        node_id = self.cluster.node_id
        log_ = TaskLog.of(self.js)
        _, fence = await log_.last_fence(task_id)
        accepted = None if fence is not None else await _first_accept(log_, task_id)
        holder = holder_to_ask(delivery, node_id, holder_of(fence, accepted),
                               claimed_before=claimed_before)
        if holder is None:
            return None
        probed = await probe(self.output.nc, holder)
        if redelivery_fate(probed) is not RedeliveryFate.PASS_TO_HOLDER:
            log.warning("task %s redelivered (delivery %d); its holder %s is %s: taken over",
                        task_id, delivery, holder, probed)
            return None
        # Here, not at the top: the hand-off module reads the inbox, which reads this one.
        from fleet.worker.handoff import HELD, offer

        taken = await offer(self.output.nc, task_id, msg, node_id, holder, HELD)
        if taken is False:
            return None  # it holds it no more and has no slot: ours, fenced
        # Taken, or perhaps taken: the message is the holder's, no verb here (as a hand-off).
        log.warning("task %s redelivered (delivery %d) while node %s, alive, holds it: "
                    "passed to it, not run twice (%s)", task_id, delivery, holder,
                    "taken" if taken else "no answer")
        return Settled(None, "passed_to_holder", Stage.SUPERSEDED)

    async def _redelivered(self, task: Task) -> Settled | None:
        """A worker took this task before and died. Rerun it if no output was streamed;
        continue a text task from its next token if some was (fleet.worker.continuation):
        a client must never see a token twice or miss one."""
        task_id = task.task_id
        last = await self.output.last_event(task_id)
        if isinstance(last, TaskFinished):
            return Settled(task_id, "already_finished", Stage.REDELIVERED_FINISHED, last)
        if not output_began(last):
            return None
        match await self.continuation(task):
            case None:
                return Settled(task_id, "already_finished", Stage.REDELIVERED_FINISHED)
            case GiveUp(message=message):
                return await self._end(task_id, ErrorReason.WORKER_LOST, message)
        return None

    async def continuation(self, task: Task) -> Continue | GiveUp | None:
        """Read back what the task's earlier attempts streamed and decide; a Continue is
        noted for the task's next dispatch."""
        await self.output.nc.flush()  # our own chunks of it (a runner crash) stored first
        events = await stored_events(self.output.nc, self.js, task.task_id)
        decided = decide(task, events)
        if isinstance(decided, Continue):
            log.info("task %s continues from token %d (continuation %d)",
                     task.task_id, len(decided.generated), decided.attempt)
            self.book.queued[task.task_id] = decided
        return decided


async def _first_accept(log_: TaskLog, task_id: str) -> TaskAccepted | None:
    """The task's first TaskAccepted among its first stored events (who ran it first)."""
    seen = 0
    async with contextlib.aclosing(log_.each(task_id, budget_s=log_.budget_s)) as stored:
        async for raw in stored:
            try:
                event = decode_event(raw.data or b"")
            except DecodeError:
                event = None
            if isinstance(event, TaskAccepted):
                return event
            seen += 1
            if seen >= ACCEPT_WITHIN:
                break
    return None
