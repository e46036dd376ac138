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
    own      (any)                  go on: a redelivery of the owner (redelivery rules apply)
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
from collections.abc import Mapping
from enum import StrEnum

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from fleet.bus.connect import MSG_ID
from fleet.bus.replies import inbox_reply
from fleet.bus.retry import with_retry
from fleet.errors import ProvisioningConflict
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import RefusedReason, TaskRefused

log = logging.getLogger(__name__)



REPORTED_ID_CHARS = 256
USED = "used-"  # a claim's value once an id is found with events and no owner


class Claim(StrEnum):
    FRESH = "fresh"  # this message has just claimed the id
    OWN = "own"  # it claimed it before: a redelivery (or a create retried after a lost reply)
    TAKEN = "taken"  # another message holds it


def judge(mine: str, holder: str | None) -> Claim:
    """The claim after a `create`: holder None means the create succeeded."""
    if holder is None:
        return Claim.FRESH
    return Claim.OWN if holder == mine else Claim.TAKEN


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


class Claims:
    def __init__(self, nc: Client, js: JetStreamContext, kv: KeyValue) -> None:
        self.nc = nc
        self.js = js
        self.kv = kv
        self.refused = 0

    @classmethod
    async def open(cls, nc: Client, js: JetStreamContext) -> Claims:
        try:
            kv = await with_retry(
                lambda: js.key_value(subjects.CLAIMS_BUCKET), what="open FLEET_CLAIMS"
            )
        except BucketNotFoundError:
            raise ProvisioningConflict(
                "KV bucket FLEET_CLAIMS is missing (ops/jetstream/KV_FLEET_CLAIMS.json): "
                "run `fleet nats --provision` as the operator"
            ) from None
        return cls(nc, js, kv)

    async def claim(self, task_id: str, owner: str, *, again: bool = True) -> Claim:
        if await with_retry(lambda: self._create(task_id, owner), what=f"claim task id {task_id}"):
            return judge(owner, None)
        holder = await with_retry(
            lambda: self._holder(task_id), what=f"read claim of task id {task_id}"
        )
        # Gone between the create and the get (its TTL just ran out): claim it afresh.
        if holder is None and again:
            return await self.claim(task_id, owner, again=False)
        return judge(owner, holder or "")

    # nats-py's KV errors carry no `code`, so they are answered inside the retried call.
    async def _create(self, task_id: str, owner: str) -> bool:
        try:
            await self.kv.create(task_id, owner.encode())
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _holder(self, task_id: str) -> str | None:
        try:
            entry = await self.kv.get(task_id)
        except KeyNotFoundError:  # KeyDeletedError is one: a purged claim is no claim
            return None
        return entry.value.decode() if entry.value else None

    async def has_events(self, task_id: str) -> bool:
        return await with_retry(
            lambda: self._has_events(task_id), what=f"look for events of task {task_id}"
        )

    async def _has_events(self, task_id: str) -> bool:
        try:
            await self.js.get_last_msg(subjects.OUT_STREAM, subjects.out(task_id))
        except NotFoundError:
            return False
        return True

    async def admit(self, task_id: str, owner: str) -> RefusedReason | None:
        """Claim `task_id` for `owner`; None when it may write on `fleet.out.<task_id>`."""
        claim = await self.claim(task_id, owner)
        earlier = claim is Claim.FRESH and await self.has_events(task_id)
        if (reason := refusal(claim, earlier)) == "task_id_used":
            # Nobody may own an id whose events are already there, this message included:
            # its redelivery would otherwise find its "own" claim and write on them.
            await with_retry(
                lambda: self.kv.put(task_id, f"{USED}{owner}".encode()),
                what=f"mark task id {task_id} used",
            )
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
        body = encode(event)
        # One record per refused message, however often it is delivered.
        headers = {MSG_ID: f"refused-{seq}"} if seq is not None else None
        await with_retry(
            lambda: self.js.publish(subjects.refused(model), body, headers=headers),
            what=f"record refusal of task {sent_id}",
        )
        if reply := reply_subject(msg.headers):
            await with_retry(
                lambda: self.nc.publish(reply, body), what=f"tell {reply} of a refusal"
            )
        return event
