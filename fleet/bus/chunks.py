"""Moving object store messages fast: an in-order reader and a pipelined chunk writer.

nats-py's own ObjectStore reads at 10-30 MB/s for 10-50 MB objects and may never return: it
answers flow control from a task that polls every 0.25 s, concatenates bytes quadratically and
has no timeout. Its writer waits for each 128 KiB chunk's ack before sending the next. Here:

- `read_in_order` runs an ephemeral push consumer over one subject and answers flow control
  as soon as everything before the request has been consumed. After a lost delivery (a
  reconnect, a client-side drop) or a consumer that went silent (deleted, server restarted) a
  new consumer resumes at the next stream sequence. No message for the idle timeout raises
  TimeoutError; heartbeats do not count as progress.
- `publish_chunks` keeps a window of chunks in flight, each awaiting its JetStream ack.

Both leave the object store's layout alone, so any client can read what the other wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.errors import NoStreamResponseError

from fleet.bus.replies import MAX_SUBJECT, flow_control

log = logging.getLogger(__name__)

# 4 to 16 chunk acks in flight all measured 300-600 MB/s for 8-32 MB; a deeper window only
# queues more bytes in the client's outgoing buffer.
PUBLISH_WINDOW = 8
HEARTBEAT_S = 1.0
# Three missed heartbeats: the reader replaces its consumer, resuming after the last chunk.
SILENT_CONSUMER_S = 3 * HEARTBEAT_S
# The server forgets a consumer whose reader vanished without deleting it after this long.
ABANDONED_CONSUMER_S = 30.0
STALLED_HEADER = "Nats-Consumer-Stalled"
NO_RESPONDERS = "503"


class StoreRefused(Exception):
    """The stream answered a chunk with an error (full, sealed, ...)."""


@dataclass(frozen=True)
class Written:
    chunks: int
    size: int
    sha256: bytes


async def read_in_order(
    nc: Client,
    js: JetStreamContext,
    stream: str,
    subject: str,
    idle_timeout: float,
    *,
    count: int | None = None,
    from_last: bool = False,
    delete: bool = True,
) -> AsyncIterator[bytes]:
    """Yield the messages stored on `subject` in stream order: the first `count` of them, or
    (`from_last`) the last one stored and every later one; None reads until the caller stops.

    Use it inside `contextlib.aclosing` so that its consumer is deleted when the caller stops;
    with `delete=False` (a role that may create consumers on the stream but not delete them)
    the server removes it after ABANDONED_CONSUMER_S without interest instead.
    """
    received = 0
    resume_at: int | None = None
    deadline = time.monotonic() + idle_timeout  # moved on by messages only, not heartbeats
    while count is None or received < count:
        _remaining(deadline)
        policy = _where_to_start(resume_at, from_last)
        async with _push_consumer(nc, js, stream, subject, policy, resume_at, delete) as sub:
            next_delivery = 1
            while count is None or received < count:
                wait = min(_remaining(deadline), SILENT_CONSUMER_S)
                try:
                    msg = await sub.next_msg(timeout=wait)
                except TimeoutError:
                    break  # not even a heartbeat: the consumer is gone (deleted, server restart)
                status = msg.headers.get(api.Header.STATUS) if msg.headers else None
                if status == api.StatusCode.CONTROL_MESSAGE:
                    await _answer_control(nc, msg.reply, msg.headers)
                    continue
                if status or msg.metadata.sequence.consumer != next_delivery:
                    break  # a delivery was lost (reconnect, client-side drop)
                next_delivery += 1
                resume_at = msg.metadata.sequence.stream + 1
                received += 1
                deadline = time.monotonic() + idle_timeout
                yield msg.data


def _where_to_start(resume_at: int | None, from_last: bool) -> api.DeliverPolicy:
    if resume_at is not None:
        return api.DeliverPolicy.BY_START_SEQUENCE
    return api.DeliverPolicy.LAST_PER_SUBJECT if from_last else api.DeliverPolicy.ALL


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no message arrived within the idle timeout")
    return left


async def _answer_control(nc: Client, reply: str | None, headers: dict[str, str]) -> None:
    # A flow-control request carries its reply subject. A heartbeat carries one in a header
    # when the server is still waiting on an answer it never got.
    # Only a flow-control subject is answered (fleet.bus.replies): whoever may publish into
    # this inbox must not be able to point the answer at a key or another task's output.
    asked = reply or headers.get(STALLED_HEADER)
    if answer_to := flow_control(asked):
        await nc.publish(answer_to)
    elif asked:
        log.warning("a control message asking for an answer on %r was not answered: not a "
                    "flow-control subject", asked[:MAX_SUBJECT])


@contextlib.asynccontextmanager
async def _push_consumer(
    nc: Client,
    js: JetStreamContext,
    stream: str,
    subject: str,
    policy: api.DeliverPolicy,
    start_seq: int | None,
    delete: bool,
) -> AsyncIterator[Subscription]:
    # Subscribe before the consumer exists, or its first deliveries would find no interest.
    sub = await nc.subscribe(nc.new_inbox())
    config = api.ConsumerConfig(
        deliver_subject=sub.subject,
        filter_subject=subject,
        deliver_policy=policy,
        opt_start_seq=start_seq,
        ack_policy=api.AckPolicy.NONE,
        flow_control=True,
        idle_heartbeat=HEARTBEAT_S,
        inactive_threshold=ABANDONED_CONSUMER_S,
        mem_storage=True,
        num_replicas=1,
    )
    try:
        consumer = await js.add_consumer(stream, config)
        try:
            yield sub
        finally:
            # Not awaiting the reply saves a round trip; should the request be lost, the
            # inactive threshold removes the consumer anyway.
            if delete:
                with contextlib.suppress(Exception):
                    await nc.publish(f"$JS.API.CONSUMER.DELETE.{stream}.{consumer.name}")
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def publish_chunks(
    nc: Client, subject: str, pieces: Iterable[bytes | memoryview], timeout: float
) -> Written:
    """Publish each piece to `subject`, hashing as it goes; every ack waits at most `timeout`.

    The acks come to one inbox of our own rather than through nats-py's publish_async, whose
    ack handler raises instead of failing the future when the stream refuses a message with a
    503 (such as "maximum bytes exceeded"), so the caller would only ever see a timeout.
    """
    digest = hashlib.sha256()
    inbox = nc.new_inbox()
    acks = await nc.subscribe(f"{inbox}.*")
    chunks = size = acked = 0
    try:
        for piece in pieces:
            digest.update(piece)
            await nc.publish(subject, piece, reply=f"{inbox}.{chunks}")
            chunks += 1
            size += len(piece)
            if chunks - acked >= PUBLISH_WINDOW:
                acked += 1
                await _take_ack(acks, timeout)
        while acked < chunks:
            acked += 1
            await _take_ack(acks, timeout)
    except BaseException:
        # A chunk still in flight could be stored after the caller purges the failed upload,
        # so hear out every outstanding answer (bounded by one timeout) before giving up.
        await _drain(acks, chunks - acked, timeout)
        raise
    finally:
        with contextlib.suppress(Exception):
            await acks.unsubscribe()
    return Written(chunks=chunks, size=size, sha256=digest.digest())


async def _drain(acks: Subscription, outstanding: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(outstanding):
        with contextlib.suppress(Exception):
            await acks.next_msg(timeout=max(deadline - time.monotonic(), 0.001))


async def _take_ack(acks: Subscription, timeout: float) -> None:
    reply = await acks.next_msg(timeout=timeout)
    if reply.headers and reply.headers.get(api.Header.STATUS) == NO_RESPONDERS:
        raise NoStreamResponseError
    error = json.loads(reply.data).get("error")
    if error:
        raise StoreRefused(error.get("description") or str(error))
