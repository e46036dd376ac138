"""Task events as the benchmark's NATS client receives them, with their receipt times."""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg

from fleet.wire.codec import decode_event
from fleet.wire.events import TaskAccepted, TaskFinished


class EventLog:
    """Every `fleet.out.*` event's receipt time and runner stamp, by task id."""

    def __init__(self) -> None:
        self.accepted: dict[str, tuple[float, float]] = {}  # task -> (received, at)
        self.finished: dict[str, tuple[float, float, str]] = {}
        self.waiters: dict[str, asyncio.Event] = {}

    async def on_event(self, msg: Msg) -> None:
        now = time.perf_counter()
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted):
            self.accepted[event.task_id] = (now, event.at)
        elif isinstance(event, TaskFinished):
            self.finished[event.task_id] = (now, event.at, event.status)
            if waiter := self.waiters.get(event.task_id):
                waiter.set()

    async def all_finished(self, task_ids: list[str], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            for task_id in task_ids:
                if task_id not in self.finished:
                    waiter = self.waiters.setdefault(task_id, asyncio.Event())
                    await waiter.wait()


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)
