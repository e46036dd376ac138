"""Deadlines kept by the broker: a task's sentinel on `fleet.deadlines.<model>.<task_id>`
(stream FLEET_DEADLINES) whose per-message TTL (`Nats-TTL`) ends at the task's deadline.
When the server removes it, it stores a delete marker (`Nats-Marker-Reason: MaxAge`) in its
place, and a worker (fleet.worker.deadlines) ends the task `expired` if it never started.

The publisher of the task sets the sentinel (`publish_deadline`): the gateway does for the
lines of batch jobs. Only trusted roles (gateway, worker, operator) may publish there: a
marker is a header, and a client that could write one could expire another's task.
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


async def publish_deadline(js: JetStreamContext, task: Task) -> None:
    """The task's sentinel (nothing for a task without a deadline)."""
    headers = ttl_header(task.deadline, time.time())
    if headers:
        subject = deadline_subject(task.model, task.task_id)
        await with_retry(lambda: js.publish(subject, b"", headers=headers),
                         what=f"set the deadline of task {task.task_id}")
