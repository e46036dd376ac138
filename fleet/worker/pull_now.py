"""A pull that never waits for tasks to arrive: the messages a durable has now, or none.

nats-py's `fetch` always sends its first request with `expires`, and the server then holds
it as a lingering pull for that long when the consumer is empty: probing three priority
classes in turn cost three such waits a pull. This sends JetStream's own `no_wait` request
(no `expires`): the server answers at once with what it has, then a status (404 none, 408
fewer than asked). It reads the subscription nats-py made for the bound durable (its next-
message subject and inbox); messages a cancelled fetch left in that inbox come first.
"""

from __future__ import annotations

import orjson
from nats.aio.msg import Msg
from nats.js import JetStreamContext

ANSWER_S = 2.0  # the server answers a no_wait pull at once; longer is an election or a stall
HEARTBEAT = "100"


async def pull_now(sub: JetStreamContext.PullSubscription, batch: int) -> list[Msg]:
    """Up to `batch` messages the durable holds now; raises TimeoutError when the server
    does not answer within ANSWER_S."""
    inbox = sub._sub
    got: list[Msg] = []
    while len(got) < batch and not inbox._pending_queue.empty():  # left by a cancelled fetch
        msg = inbox._pending_queue.get_nowait()
        inbox._pending_size -= len(msg.data)
        if not JetStreamContext.is_status_msg(msg):
            got.append(msg)
    if len(got) == batch:
        return got
    request = orjson.dumps({"batch": batch - len(got), "no_wait": True})
    await sub._nc.publish(sub._nms, request, reply=sub._deliver)
    while len(got) < batch:
        msg = await inbox.next_msg(timeout=ANSWER_S)
        status = JetStreamContext.is_status_msg(msg)
        if status == HEARTBEAT:
            continue
        if status:  # no more now (404, 408), or a stale status of an earlier pull: done
            break
        got.append(msg)
    return got
