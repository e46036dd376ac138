"""Routing across nodes: a pulled task message passed to the node whose runner should run it,
and other nodes' runners as their workers advertise them.

Why a hand-off of the held message rather than a per-runner queue: the message never leaves
FLEET_TASKS. The sender forwards its subject, headers, body and JetStream ack subject
(`TaskHandOff`, a core request on `fleet.handoff.<node>`); the receiver rebuilds the message
and takes it in through its ordinary intake, then heartbeats and acks it as its own. So the
task keeps its stream sequence (its task-id claim), its delivery count (continuation,
MaxDeliver, dead letters) and its AckWait: if the receiver dies, JetStream redelivers it to
whoever pulls next, as for any worker. Exactly one worker holds it at any moment:

    answer            the sender
    taken             forgets the message (no verb): the receiver holds it now
    declined          keeps it and runs it here (never offered again)
    no responders     keeps it and runs it here (nobody received it)
    no answer in time forgets it (no verb): the receiver may hold it; if it does not,
                      AckWait redelivers it (rare: a lost reply costs one AckWait)

Subjects in an offer are capabilities (fleet.bus.replies): the receiver answers only on an
inbox, and takes in only a message whose ack subject acks a FLEET_TASKS delivery, so a sender
cannot point its `+ACK`/`+WPI` or its answer at a key, an object or another task's output.
An offer with another reply is dropped unanswered; one with another ack subject is declined.

The same request passes a redelivery back to the node that still holds the task
(fleet.worker.takeover, `redelivery_fate`; runner `HELD`): a receiver that holds that stream
message takes it whatever its slots and keeps it renewed under the newer delivery; one that
does not any more treats it as any offer, and a declined one is taken over by its sender.

The receiver answers before its intake runs and takes a task only into a free slot
(`plan.declines_hand_off`), never passes a handed-in task on, and a sender never offers a
task that carries input images (they are fetched here already). A stopping receiver first
closes its subscription (later offers find no responder) and declines the offers already
queued, so no offer waits on a worker that has stopped reading them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from fleet.bus.replies import MAX_SUBJECT, inbox_reply, task_ack
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_model, encode
from fleet.wire.handoff import HandOffAnswer, TaskHandOff
from fleet.wire.prefixes import PrefixSummary
from fleet.worker.inbox import HandedIn, Inbox
from fleet.worker.routing import PrefixHeld
from fleet.worker.state import HandOffEnded, RemoteRunner, RemoteRunnersSeen

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 2.0  # the receiver answers from its loop, before its intake's I/O
# The receiver takes an offer only this soon after it arrived, so a sender still waits when
# "taken" is sent: an offer its sender gave up on is declined, never run beside a redelivery.
TAKE_WITHIN_S = ANSWER_TIMEOUT_S / 2
HELD = "held"  # the runner a redelivery passed to its holder names: the one that holds it


def hand_off_of(msg: Msg, from_node: str, runner_id: str) -> TaskHandOff:
    return TaskHandOff(
        from_node=from_node, runner_id=runner_id, subject=msg.subject, ack_subject=msg.reply,
        headers=dict(msg.headers or {}), data=msg.data.decode(),
    )


def rebuilt(nc: Client, hand_off: TaskHandOff) -> Msg:
    """The handed-over message as the receiver holds it: its verbs go to the same delivery."""
    return Msg(
        _client=nc, subject=hand_off.subject, reply=hand_off.ack_subject,
        data=hand_off.data.encode(), headers=dict(hand_off.headers) or None,
    )


class HandOffs:
    def __init__(self, nc: Client, node_id: str, inbox: Inbox) -> None:
        self.nc = nc
        self.node_id = node_id
        self.inbox = inbox
        self._sub: Subscription | None = None
        self.closed = False

    async def subscribe(self) -> None:
        """Before the worker says it is ready: a sender's request finds us from then on."""
        self._sub = await self.nc.subscribe(subjects.handoff(self.node_id))

    async def listen(self) -> None:
        """Hand-offs to this node, to the loop; a restart after a failure subscribes again.
        Once closed it holds no subscription and waits for its owner to cancel it."""
        if not self.closed:
            await self._offers()
        if self.closed:
            await asyncio.Event().wait()

    async def close(self) -> None:
        """Take no more offers (the worker is stopping): a sender's next offer finds no
        responder and the sender runs the task itself at once, where an offer queued behind
        the stop would go unanswered and leave the task to AckWait."""
        self.closed = True
        sub, self._sub = self._sub, None
        if sub is not None:
            await _unsubscribe(sub)

    async def _offers(self) -> None:
        sub = self._sub or await self.nc.subscribe(subjects.handoff(self.node_id))
        self._sub = sub
        try:
            async for msg in sub.messages:
                if (reply := inbox_reply(msg.reply)) is None:
                    log.warning("a hand-off whose reply subject %r is not an inbox was "
                                "dropped unanswered", (msg.reply or "")[:MAX_SUBJECT])
                    continue
                try:
                    hand_off = decode_model(TaskHandOff, msg.data)
                except DecodeError as exc:
                    log.warning("a hand-off that is not one was declined: %s", exc)
                    await self.answer(reply, False, "invalid hand-off")
                    continue
                if task_ack(hand_off.ack_subject) is None:
                    log.warning("a hand-off whose ack subject %r acks no FLEET_TASKS delivery "
                                "was declined", hand_off.ack_subject[:MAX_SUBJECT])
                    await self.answer(reply, False, "invalid hand-off")
                    continue
                self.inbox.put_nowait(HandedIn(hand_off, reply, time.monotonic()))
        finally:
            if self._sub is sub:
                self._sub = None
                await _unsubscribe(sub)

    async def answer(self, reply: str, taken: bool, reason: str = "") -> None:
        """A core reply; a lost one leaves the sender to its timeout (see the table above).
        Only on an inbox: the reply is the sender's to choose, the grants are this worker's."""
        if inbox_reply(reply) is None:
            log.error("hand-off answer (taken=%s) not sent: %r is not an inbox", taken, reply)
            return
        try:
            await self.nc.publish(reply, encode(HandOffAnswer(taken=taken, reason=reason)))
        except Exception as exc:
            log.warning("hand-off answer (taken=%s) not sent: %s: %s",
                        taken, type(exc).__name__, exc)

    async def send(self, task_id: str, node_id: str, runner_id: str, msg: Msg) -> None:
        """Offer a held message to `node_id`; the outcome goes to the loop as HandOffEnded."""
        taken: bool | None = None
        try:
            taken = await offer(self.nc, task_id, msg, self.node_id, node_id, runner_id)
        finally:
            self.inbox.put_nowait(HandOffEnded(task_id, node_id, runner_id, taken, time.time()))


async def offer(
    nc: Client, task_id: str, msg: Msg, from_node: str, node_id: str, runner_id: str
) -> bool | None:
    """Offer the held `msg` to `node_id` once: taken, declined (False: also when nobody
    listens there), or None when its outcome is unknown (see the table above)."""
    try:
        reply = await nc.request(
            subjects.handoff(node_id), encode(hand_off_of(msg, from_node, runner_id)),
            timeout=ANSWER_TIMEOUT_S,
        )
        answer = decode_model(HandOffAnswer, reply.data)
        if not answer.taken:
            log.info("task %s: node %s declined it (%s); run here", task_id, node_id,
                     answer.reason)
        return answer.taken
    except NoRespondersError:
        log.info("task %s: node %s is not there; run here", task_id, node_id)
        return False  # nobody listens there: nobody received it
    except (NatsTimeout, TimeoutError):
        log.warning("task %s: node %s did not answer its hand-off; left to it or to "
                    "AckWait", task_id, node_id)
    except Exception as exc:  # not known to be received: the safe side is AckWait
        log.warning("task %s: hand-off to %s failed (%s: %s); left to AckWait",
                    task_id, node_id, type(exc).__name__, exc)
    return None


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception as exc:  # already gone with its connection: nothing to undo
        log.debug("hand-off subscription not unsubscribed: %s", exc)


def remote_runner(summary: PrefixSummary) -> RemoteRunner:
    order = tuple(int(block, 16) for block in summary.blocks)
    return RemoteRunner(
        runner_id=summary.runner_id, node_id=summary.node_id, model=summary.model,
        slots=summary.slots, in_flight=summary.in_flight,
        held=PrefixHeld(order, frozenset(order)), at=summary.at,
        prefill_blocks=summary.prefill_blocks, prefilling=summary.prefilling,
        spare_cores=summary.spare_cores,
    )


class RemoteRunners:
    """FLEET_PREFIXES, mirrored (fleet.bus.kv_mirror), parsed once per changed key and sent
    to the loop whole after each change."""

    def __init__(self, node_id: str, inbox: Inbox) -> None:
        self.node_id = node_id
        self.inbox = inbox
        self.runners: dict[str, RemoteRunner] = {}

    def changed(self, values: dict[str, bytes], key: str | None) -> None:
        keys = list(values) if key is None else [key]
        if key is None:
            self.runners = {}
        for name in keys:
            self.runners.pop(name, None)
            if (value := values.get(name)) is None:
                continue
            try:
                summary = decode_model(PrefixSummary, value)
            except DecodeError as exc:
                log.warning("prefix summary %s ignored: %s", name, exc)
                continue
            if summary.node_id != self.node_id:
                self.runners[name] = remote_runner(summary)
        # By runner id, as the loop looks them up (a hand-off's answer names the runner),
        # not by the advert's key (`<model>.<runner id>`).
        self.inbox.put_nowait(RemoteRunnersSeen({r.runner_id: r for r in self.runners.values()}))
