"""Who owns a task id: the first task message that claims it, before anything is written on
`fleet.out.<task_id>`.

Anyone who may publish tasks chooses the id, so an id alone proves nothing: without a claim a
second message with a victim's id (on an unknown model, an invalid one, or a plain duplicate)
could write a forged terminal, or tokens after the real one. So every path that writes on
`fleet.out.<id>` first claims the id in the KV bucket FLEET_CLAIMS with `create` (atomic: it
fails when the key exists). The value is the owner: the message's FLEET_TASKS stream sequence
(or a one-off token for the janitor, whose core subscription sees no sequence).

    claim    events in FLEET_OUT    verdict
    fresh    none                   go on: this message owns the id now
    fresh    some                   refused, task_id_used (an old id whose claim expired);
                                    the claim is marked used, so no message owns it
    own      (any)                  go on: a redelivery of the owner (redelivery rules apply,
                                    even at a delivery count of 1: fleet.worker.takeover)
    taken    (any)                  refused, task_id_taken

A refused message writes nothing on `fleet.out.<id>`; its publisher learns why from a
TaskRefused on `fleet.refused.<model>` (stream FLEET_REFUSED) and, when the message carries a
`Fleet-Reply-To: _INBOX.…` header, on that inbox. Claims live 2 h, twice FLEET_OUT's max age,
so a claim outlives the events of any task that ran less than an hour; the FLEET_OUT check of
a fresh claim covers the rest. Ids should be unguessable (the gateway's are uuid4): whoever
claims an id first owns it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError
from nats.js import JetStreamContext

from fleet.aio import cancel_and_wait, started
from fleet.bus.pipelined import Sent, pipelined_for, stream_answer
from fleet.bus.records import ClaimRecords
from fleet.bus.replies import inbox_reply
from fleet.bus.task_log import TaskLog, holds_message
from fleet.bus.task_queue import TaskQueue
from fleet.wire import subjects
from fleet.wire.events import RefusedReason, TaskRefused

log = logging.getLogger(__name__)

REPORTED_ID_CHARS = 256
USED = "used-"  # a claim's value once an id is found with events and no owner
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # a create refused: the key has a message (live or a marker)
# Claims sent ahead and not (yet) admitted, kept at most: a message fetched and then not
# taken in (a redelivery of one held here) leaves its entry until it is pushed out.
AHEAD_KEPT = 1024


class Claim(StrEnum):
    FRESH = "fresh"  # this message has just claimed the id
    OWN = "own"  # it claimed it before: a redelivery (or a create retried after a lost reply)
    TAKEN = "taken"  # another message holds it


def judge(mine: str, holder: str | None) -> Claim:
    """The claim after a `create`: holder None means the create succeeded."""
    if holder is None:
        return Claim.FRESH
    return Claim.OWN if holder == mine else Claim.TAKEN


def created(answer: bytes) -> bool | None:
    """Pure. The stream's answer to a claim's create (a publish expecting no message on the
    key): True when stored, False when the key has a message (a live claim, or a delete
    marker, which only the retried create tells apart), None for any other answer (an error,
    or not an answer at all): the retried create decides then."""
    if (reply := stream_answer(answer)) is None:
        return None
    error = reply.get("error")
    if error is None:
        return True if reply.get("seq") else None
    return False if isinstance(error, dict) and error.get("err_code") == WRONG_LAST_SEQUENCE \
        else None


def refusal(claim: Claim, earlier_events: bool) -> RefusedReason | None:
    """Why a message with this claim is refused, or None to let it go on."""
    if claim is Claim.TAKEN:
        return "task_id_taken"
    if claim is Claim.FRESH and earlier_events:
        return "task_id_used"
    return None


def reply_subject(headers: Mapping[str, str] | None) -> str | None:
    """The publisher's `Fleet-Reply-To` inbox, when it set a usable one: only inboxes are
    answered (fleet.bus.replies), so a header naming `fleet.out.<victim>` or a KV key makes
    this worker write nothing there."""
    return inbox_reply((headers or {}).get(subjects.REPLY_HEADER))


def stream_seq(msg: Msg) -> int | None:
    """A JetStream message's stream sequence; None for a core message (the janitor's view)."""
    try:
        return msg.metadata.sequence.stream
    except NotJSMessageError:
        return None


def owner_of(msg: Msg) -> str:
    """A task message's claim value: its FLEET_TASKS sequence, the same on every delivery."""
    seq = stream_seq(msg)
    return one_off_owner() if seq is None else str(seq)


def one_off_owner() -> str:
    return f"once-{uuid.uuid4().hex}"


_EXPLAIN: dict[str, str] = {
    "task_id_taken": "task id {id!r} belongs to another task message; nothing was written on "
    "its events",
    "task_id_used": "task id {id!r} was used before and has events; choose a new id",
}


@dataclass(frozen=True)
class Ahead:
    """A claim's create and its events look-up, sent before the intake admits the message."""

    create: Sent
    lookup: Sent


class Claims:
    """The claim rules over the claim records (fleet.bus.records), the task log (events
    already there?) and the task queue (where a refusal is recorded)."""

    def __init__(self, nc: Client, js: JetStreamContext, records: ClaimRecords) -> None:
        self.nc = nc
        self.records = records
        self.log = TaskLog(nc, js)
        self.queue = TaskQueue(nc, js)
        self.refused = 0
        self._ahead: OrderedDict[tuple[str, str], Ahead] = OrderedDict()

    async def ahead(self, task_id: str, owner: str) -> None:
        """Send the claim's create and its events look-up now, for `admit` to read: a
        fetched message's claim goes out before the worker's loop takes the message in, so
        its round trip runs beside the loop's hops (issue 23: the claim was sent ~0.7 ms
        after the fetch, at light load). The same requests `admit` would send, answered the
        same way: only who waits for the answer moves. Never raises (`admit` sends its own)."""
        key = (task_id, owner)
        if key in self._ahead:
            return
        fast = pipelined_for(self.nc)
        try:
            create = await fast.send(f"{self.records.kv._pre}{task_id}", owner.encode(),
                                     {EXPECTED_LAST_SUBJECT_SEQ: "0"})
            lookup = await fast.send(*self.log.events_lookup(task_id))
        except Exception as exc:
            log.debug("task %s: the claim was not sent ahead (%r)", task_id, exc)
            return
        self._ahead[key] = Ahead(create, lookup)
        while len(self._ahead) > AHEAD_KEPT:
            _, dropped = self._ahead.popitem(last=False)
            fast.forget(dropped.create)
            fast.forget(dropped.lookup)

    @classmethod
    async def open(cls, nc: Client, js: JetStreamContext) -> Claims:
        return cls(nc, js, await ClaimRecords.open(js))

    async def claim(self, task_id: str, owner: str, *, again: bool = True,
                    sent: Sent | None = None) -> Claim:
        """`sent`: the create, sent ahead (`ahead`); its answer is read as `_create_now`'s."""
        if again and await self._create_now(task_id, owner, sent):
            return judge(owner, None)
        if await self.records.create(task_id, owner):
            return judge(owner, None)
        holder = await self.records.holder(task_id)
        # Gone between the create and the get (its TTL just ran out): claim it afresh.
        if holder is None and again:
            return await self.claim(task_id, owner, again=False)
        return judge(owner, holder or "")

    async def _create_now(self, task_id: str, owner: str, sent: Sent | None = None) -> bool:
        """The create as one pipelined publish (fleet.bus.pipelined): True when it stored the
        claim; False for anything else, left to the retried create (`records.create`), which
        reads what it finds as before (an answer lost after the store: its own claim, OWN)."""
        kv = self.records.kv
        fast = pipelined_for(self.nc)
        try:
            answer = await (fast.answer(sent) if sent is not None else fast.request(
                f"{kv._pre}{task_id}", owner.encode(), {EXPECTED_LAST_SUBJECT_SEQ: "0"}))
        except Exception as exc:  # the retried create takes over (and says why if it fails)
            log.debug("task %s: the claim's fast create had no answer (%r)", task_id, exc)
            return False
        return created(answer.data) is True

    async def has_events(self, task_id: str) -> bool:
        return await self.log.has_events(task_id)

    async def _has_events(self, task_id: str, sent: Ahead | None) -> bool:
        """The look-up sent ahead, read as `has_events` reads its own; anything but an
        answer falls back to it (retried)."""
        if sent is not None:
            try:
                return holds_message((await pipelined_for(self.nc).answer(sent.lookup)).data)
            except Exception as exc:
                log.debug("task %s: the look-up sent ahead had no answer (%r)", task_id, exc)
        return await self.has_events(task_id)

    async def admit(self, task_id: str, owner: str) -> RefusedReason | None:
        """Claim `task_id` for `owner`; None when it may write on `fleet.out.<task_id>`."""
        return (await self.admit_claim(task_id, owner))[1]

    async def admit_claim(self, task_id: str, owner: str) -> tuple[Claim, RefusedReason | None]:
        """`admit`, with the claim it found: OWN says an earlier delivery of this very message
        claimed the id, whatever the delivery count says (fleet.worker.intake).

        The events look-up goes out beside the claim's create, not after it: they are two
        round trips on every task's way to its runner (issue 23), and the look-up's answer
        counts only for a fresh claim. Read before the create lands or after, it sees the
        same: only a claim's holder writes on `fleet.out.<id>`, and a fresh claim had none.
        """
        sent = self._ahead.pop((task_id, owner), None)
        if sent is not None:
            # Both already in flight (`ahead`): their answers are read in turn, with no task
            # of their own to start and end (two of a task's ~60 loop passes, issue 23).
            try:
                claim = await self.claim(task_id, owner, sent=sent.create)
                earlier = claim is Claim.FRESH and await self._has_events(task_id, sent)
            finally:  # a look-up whose answer does not count is left unread
                pipelined_for(self.nc).forget(sent.lookup)
            return claim, await self._verdict(task_id, owner, claim, earlier)
        # Owned here, its failure logged by `started` (and raised below when it counts).
        events = started(self._has_events(task_id, None), f"events look-up of {task_id}")
        try:
            claim = await self.claim(task_id, owner)
            earlier = claim is Claim.FRESH and await events
        finally:  # a look-up not needed (or left by a failed claim) is ended
            await cancel_and_wait([events])
        return claim, await self._verdict(task_id, owner, claim, earlier)

    async def _verdict(self, task_id: str, owner: str, claim: Claim,
                       earlier: bool) -> RefusedReason | None:
        if (reason := refusal(claim, earlier)) == "task_id_used":
            # Nobody may own an id whose events are already there, this message included:
            # its redelivery would otherwise find its "own" claim and write on them.
            await self.records.hold(task_id, f"{USED}{owner}")
        return reason

    async def refuse(
        self, msg: Msg, model: str, sent_id: str | None, reason: RefusedReason,
        message: str | None = None,
    ) -> TaskRefused:
        """Record and answer a refusal; nothing is written on `fleet.out.<sent_id>`."""
        self.refused += 1
        seq = stream_seq(msg)
        text = message or _EXPLAIN[reason].format(id=sent_id)
        if sent_id is not None and len(sent_id) > REPORTED_ID_CHARS:
            # A report, never a subject: cut so the refusal itself fits in one message.
            text += f" (task_id shown as its first {REPORTED_ID_CHARS} of {len(sent_id)} chars)"
            sent_id = sent_id[:REPORTED_ID_CHARS]
        event = TaskRefused(
            task_id=sent_id, model=model, reason=reason, message=text, at=time.time(),
            stream_seq=seq,
        )
        log.warning("refused a task on %s (%s): %s", msg.subject, reason, text)
        await self.queue.refuse(model, event, reply_subject(msg.headers))
        return event
