"""A pull that never waits for tasks to arrive: the messages a durable has now, or none.

nats-py's `fetch` always sends its first request with `expires`, and the server then holds
it as a lingering pull for that long when the consumer is empty: probing three priority
classes in turn cost three such waits a pull. This sends JetStream's own `no_wait` request
(no `expires`): the server answers at once with what it has, then a status (404 none, 408
fewer than asked). A 503 (no responders: the durable is gone, or its leader is being elected)
raises, so the puller looks the durable up and makes it again (fleet.worker.pulls); read as
"none now" it would leave a deleted class's durable unnoticed while its other classes kept
the worker busy. It reads the subscription nats-py made for the bound durable (its next-
message subject and inbox); messages a cancelled fetch left in that inbox come first.
"""

from __future__ import annotations

import asyncio

import orjson
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

ANSWER_S = 2.0  # the server answers a no_wait pull at once; longer is an election or a stall
HEARTBEAT = "100"
NO_RESPONDERS = "503"


async def next_delivered(inbox: Subscription, timeout: float) -> Msg:
    """The next message of a subscription without a callback, as nats-py's `next_msg` reads
    it (its queue, and the pending size that the slow-consumer limit weighs), less what
    `next_msg` adds a call: a task, `wait_for`'s own task and a uuid4 name, two loop passes
    and a getrandom call between a task's arrival and its sweep (fleet.worker.pulls), and
    for each message of a pull's answer here (issue 23). Raises TimeoutError. A read so is
    not cancelled by the connection's close, as a `next_msg` is: its owner ends it, or its
    timeout."""
    async with asyncio.timeout(timeout):
        msg = await inbox._pending_queue.get()
    inbox._pending_size -= len(msg.data)
    inbox._pending_queue.task_done()
    return msg


async def pull_now(sub: JetStreamContext.PullSubscription, batch: int) -> list[Msg]:
    """Up to `batch` messages the durable holds now; raises TimeoutError when the server
    does not answer within ANSWER_S."""
    inbox = sub._sub
    got: list[Msg] = []
    while len(got) < batch and not inbox._pending_queue.empty():  # left by a cancelled fetch
        msg = inbox._pending_queue.get_nowait()
        inbox._pending_size -= len(msg.data)
        inbox._pending_queue.task_done()  # read, as next_msg counts it (a drain joins it)
        if not JetStreamContext.is_status_msg(msg):
            got.append(msg)
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
