"""Deadlines kept by the broker: a task's sentinel on `fleet.deadlines.<model>.<task_id>`
(stream FLEET_DEADLINES) whose per-message TTL (`Nats-TTL`) ends at the task's deadline.
When the server removes it, it stores a delete marker (`Nats-Marker-Reason: MaxAge`) in its
place, and a worker (fleet.worker.deadlines) ends the task `expired` if it never started.

The publisher of the task sets the sentinel (`publish_deadline`): the gateway does for what
it publishes (requests and batch lines). It also gives the task message a TTL
(`task_ttl_header`), but TAKEOVER_GRACE_S longer than the deadline: the deadline is a start-by
time kept by the sentinel, and a message the broker dropped at the deadline could no longer
be taken over should the worker that started it die then (AckWait, or the deathwatch's nak,
hands a message to another worker only while the stream holds it): the task would end never,
its streamed output without a terminal. Within the grace its redelivery ends it `expired`
(the output kept) instead of continuing it past its deadline (fleet.worker.intake).

Only trusted roles (gateway, worker, operator) may publish sentinels: a marker is a header,
and a client that could write one could expire another's task.
"""

from __future__ import annotations

import math
import time
from datetime import datetime

from nats.js import JetStreamContext

from fleet.bus.retry import with_retry
from fleet.wire.tasks import Task

STREAM = "FLEET_DEADLINES"
MARKER = "Nats-Marker-Reason"
TTL = "Nats-TTL"
# How long a task message outlives its deadline: a worker that started the task and dies
# within it (before or after the deadline: a started task runs on) is taken over and the task
# ends with a terminal; an unstarted one waits no longer than this to be dropped (a worker
# that pulls it meanwhile is refused its claim: the sentinel's worker took it).
TAKEOVER_GRACE_S = 300


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


def task_ttl_header(deadline: datetime | None, now: float,
                    grace_s: int = TAKEOVER_GRACE_S) -> dict[str, str]:
    """The task message's own TTL: its deadline plus `grace_s` (see TAKEOVER_GRACE_S)."""
    seconds = ttl_seconds(deadline, now)
    return {} if seconds is None else {TTL: f"{seconds + grace_s}s"}


def expires(msg_headers: dict[str, str] | None) -> bool:
    """A delete marker left where a sentinel's TTL ran out (not the sentinel itself)."""
    return (msg_headers or {}).get(MARKER) == "MaxAge"


async def publish_deadline(js: JetStreamContext, task: Task) -> None:
    """The task's sentinel (nothing for a task without a deadline)."""
    headers = ttl_header(task.deadline, time.time())
    if headers:
        subject = deadline_subject(task.model, task.task_id)
        await with_retry(lambda: js.publish(subject, b"", headers=headers),
                         what=f"set the deadline of task {task.task_id}")
