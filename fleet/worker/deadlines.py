"""Deadlines in the broker: a task not started by its deadline expires without a worker
pulling it, and says so in its terminal event (`expired`, reason `deadline`).

When a task with a deadline is published, one worker of the fleet sees it (a core
subscription to `fleet.tasks.>` in the queue group `fleet-deadlines`) and puts a sentinel on
`fleet.deadlines.<model>.<task_id>` (stream FLEET_DEADLINES) whose per-message TTL (`Nats-TTL`)
ends at the deadline. The server removes it then and, as it was the subject's only message,
stores a delete marker (`Nats-Marker-Reason: MaxAge`) in its place. The workers share one
durable consumer of those markers: the worker that gets one claims the task id
(fleet.worker.claims) with a one-off owner; the claim succeeds only if no task message ever
claimed it, i.e. the task never started, and then that worker writes the expired terminal.
A task that started holds its claim, so its marker changes nothing; a task message pulled
after the marker is refused (`task_id_taken`) and never runs.

The publisher may also set `Nats-TTL` on the task message itself (the gateway's batch lines
do): the broker then drops it unstarted, so no worker ever pulls it. Without it, the message
stays queued until a worker pulls and refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from datetime import datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.bus.retry import with_retry
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task
from fleet.wire.events import ErrorReason
from fleet.worker.claims import Claims
from fleet.worker.janitor import Janitor
from fleet.worker.pulls import unsubscribe_pull

log = logging.getLogger(__name__)

STREAM = "FLEET_DEADLINES"
DURABLE = "deadlines"
MARKER = "Nats-Marker-Reason"
TTL = "Nats-TTL"


def deadline_subject(model: str, task_id: str) -> str:
    return f"fleet.deadlines.{model}.{task_id}"


def task_of(subject: str) -> str:
    return subject.rsplit(".", 1)[-1]


def ttl_seconds(deadline: datetime | None, now: float) -> int | None:
    """The per-message TTL that ends at `deadline` (whole seconds, rounded up, at least 1:
    the broker's TTLs are at least a second); None without a deadline."""
    if deadline is None:
        return None
    return max(1, math.ceil(deadline.timestamp() - now))


def ttl_header(deadline: datetime | None, now: float) -> dict[str, str]:
    seconds = ttl_seconds(deadline, now)
    return {} if seconds is None else {TTL: f"{seconds}s"}


def expires(msg_headers: dict[str, str] | None) -> bool:
    """A delete marker left where a sentinel's TTL ran out (not the sentinel itself)."""
    return (msg_headers or {}).get(MARKER) == "MaxAge"


class DeadlineWatch:
    def __init__(self, nc: Client, js: JetStreamContext, janitor: Janitor) -> None:
        """`janitor`: writes the terminal (it publishes terminals the same way)."""
        self.nc = nc
        self.js = js
        self.janitor = janitor

    async def start(self) -> None:
        self.claims = await Claims.open(self.nc, self.js)
        self.markers = await self.js.pull_subscribe("", durable=DURABLE, stream=STREAM)
        await self.nc.subscribe(subjects.TASKS_ALL, queue="fleet-deadlines", cb=self._seen)
        self._loop = asyncio.create_task(self._expire_forever(), name="deadline watch")

    async def stop(self) -> None:
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop
        await unsubscribe_pull(self.markers)

    async def _seen(self, msg: Msg) -> None:
        try:
            await self.schedule(msg.data)
        except Exception as exc:  # a core message: nothing redelivers it, so say so
            log.warning("no deadline sentinel for a task on %s: %s", msg.subject, exc)

    async def schedule(self, data: bytes) -> None:
        """The sentinel of a task just published (nothing for a task without a deadline)."""
        try:
            task = decode_task(data)
        except DecodeError:
            return  # the intake refuses it; nothing to expire
        headers = ttl_header(task.deadline, time.time())
        if headers:
            subject = deadline_subject(task.model, task.task_id)
            await with_retry(lambda: self.js.publish(subject, b"", headers=headers),
                             what=f"set the deadline of task {task.task_id}")

    async def _expire_forever(self) -> None:
        while True:
            try:
                msgs = await self.markers.fetch(32, timeout=5.0)
            except TimeoutError:
                continue
            except Exception as exc:
                log.warning("deadline marker fetch failed: %s", exc)
                await asyncio.sleep(1.0)  # pacing a retry after a broker error
                continue
            for msg in msgs:
                try:
                    if expires(msg.headers):
                        await self._expire(task_of(msg.subject))
                    await msg.ack()
                except Exception as exc:  # redelivered after AckWait; the claim keeps it once
                    log.warning("expiring %s failed, retried later: %s", msg.subject, exc)

    async def _expire(self, task_id: str) -> None:
        # One owner per task for every marker of it: a marker redelivered after a failed
        # terminal finds its own claim and writes the terminal (its msg id keeps it once).
        if await self.claims.admit(task_id, f"deadline-{task_id}") is not None:
            return  # it started (its message holds the claim), or it was expired already
        log.info("task %s expired unstarted: its deadline passed in the queue", task_id)
        await self.janitor._finish(task_id, ErrorReason.DEADLINE,
                                   "the deadline passed before it started (expired in the queue)")

