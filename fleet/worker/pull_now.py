"""Pulls read from the subscription's queue directly: one that never waits for tasks to
arrive (`pull_now`: the messages a durable has now, or none), and one that waits for the
next task (`pull_waiting`: the long wait of fleet.worker.pulls, often cancelled).

nats-py's `fetch` always sends its first request with `expires`, and the server then holds
it as a lingering pull for that long when the consumer is empty: probing three priority
classes in turn cost three such waits a pull. `pull_now` sends JetStream's own `no_wait`
request (no `expires`): the server answers at once with what it has, then a status (404 none,
408 fewer than asked). A 503 (no responders: the durable is gone, or its leader is being
elected) raises, so the puller looks the durable up and makes it again (fleet.worker.pulls);
read as "none now" it would leave a deleted class's durable unnoticed while its other classes
kept the worker busy. Both read the subscription nats-py made for the bound durable (its
next-message subject and inbox); messages a cancelled pull left in that inbox come first.

Neither reads by nats-py's `next_msg`: it takes a message from the queue in a task of its
own, and a cancel that lands on its caller after that task ended and before the caller
resumed drops the message, which the server then sends again only after AckWait (30 s). A
read here (`next_delivered`) takes the message in the caller's own step, or leaves it queued.
"""

from __future__ import annotations

import asyncio

import orjson
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

ANSWER_S = 2.0  # the server answers a no_wait pull at once; longer is an election or a stall
HEARTBEAT = "100"
NO_RESPONDERS = "503"
# Statuses a wait reads past: none now (404), a request's end (408: an earlier one's,
# or this one's as its time runs out), a pull request in conflict (409) - as nats-py's fetch
# reads them.
PASSING = frozenset({HEARTBEAT, "404", "408", "409"})
# A waiting request ends on the server this much before its wait here: its 408 comes before
# the wait's own time out (nats-py's fetch sends the same).
EXPIRES_AHEAD_NS = 100_000


async def next_delivered(inbox: Subscription, timeout: float) -> Msg:
    """The next message of a subscription without a callback, as nats-py's `next_msg` reads
    it (its queue, and the pending size that the slow-consumer limit weighs), less what
    `next_msg` adds a call: a task, `wait_for`'s own task and a uuid4 name, two loop passes
    and a getrandom call between a task's arrival and its sweep (fleet.worker.pulls), and
    for each message of a pull's answer here (issue 23). Raises TimeoutError. Cancelled, it
    leaves the message queued unless it has returned it (the queue's get takes it in this
    task's own step). A read so is not cancelled by the connection's close, as a `next_msg`
    is: its owner ends it, or its timeout."""
    async with asyncio.timeout(timeout):
        msg = await inbox._pending_queue.get()
    inbox._pending_size -= len(msg.data)
    inbox._pending_queue.task_done()
    return msg


def _left(inbox: Subscription, batch: int) -> list[Msg]:
    """Up to `batch` messages a cancelled pull left queued (their statuses dropped: they
    answered requests that are over)."""
    got: list[Msg] = []
    while len(got) < batch and not inbox._pending_queue.empty():
        msg = inbox._pending_queue.get_nowait()
        inbox._pending_size -= len(msg.data)
        inbox._pending_queue.task_done()  # read, as next_msg counts it (a drain joins it)
        if not JetStreamContext.is_status_msg(msg):
            got.append(msg)
    return got


async def pull_now(sub: JetStreamContext.PullSubscription, batch: int) -> list[Msg]:
    """Up to `batch` messages the durable holds now; raises TimeoutError when the server
    does not answer within ANSWER_S."""
    inbox = sub._sub
    got = _left(inbox, batch)
    if len(got) == batch:
        return got
    request = orjson.dumps({"batch": batch - len(got), "no_wait": True})
    await sub._nc.publish(sub._nms, request, reply=sub._deliver)
    while len(got) < batch:
        msg = await next_delivered(inbox, ANSWER_S)
        status = JetStreamContext.is_status_msg(msg)
        if status == HEARTBEAT:
            continue
        if status == NO_RESPONDERS and not got:
            raise ServiceUnavailableError(description=f"no responders on {sub._nms}")
        if status:  # no more now (404, 408), or a stale status of an earlier pull: done
            break
        got.append(msg)
    return got


async def pull_waiting(sub: JetStreamContext.PullSubscription, wait_s: float) -> list[Msg]:
    """The durable's next message, waiting up to `wait_s` for one (a request with `expires`,
    as nats-py's fetch of one sends), or none. Cancelled, what its request brings stays in
    the subscription's queue: the class's next pull, or the sweep of the request
    (fleet.worker.pulls), takes it. Raises a status that is an error (503: ServiceUnavailable-
    Error) as nats-py's fetch does."""
    inbox = sub._sub
    if got := _left(inbox, 1):
        return got
    loop = asyncio.get_running_loop()
    until = loop.time() + wait_s
    request = orjson.dumps({"batch": 1, "expires": int(wait_s * 1e9) - EXPIRES_AHEAD_NS})
    await sub._nc.publish(sub._nms, request, reply=sub._deliver)
    while (left := until - loop.time()) > 0:
        try:
            msg = await next_delivered(inbox, left)
        except TimeoutError:
            return []
        status = JetStreamContext.is_status_msg(msg)
        if not status:
            return [msg]
        if status not in PASSING:
            APIError.from_msg(msg)  # raises: 503 as ServiceUnavailableError
    return []
