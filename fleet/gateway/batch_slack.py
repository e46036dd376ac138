"""Batch work fills slack: a batch line enters its model's queue (FLEET_TASKS) only while few
tasks wait there undelivered, so an interactive request never queues behind a job's lines.

Workers pull only as many tasks as they have free slots, so a task that waits undelivered in
the queue means every slot is busy. The rule (`lines_to_feed`, pure):

- while fewer than LOW_WATER lines wait undelivered, a line may go in (those waiting keep
  the slots fed the moment one frees: no idle step between two lines);
- otherwise the job waits; lines wait on their own subject (the batch class), which workers
  pull only after the interactive and default ones, so none of them is ahead of a chat;
- starvation is bounded: a job that has fed nothing for PROMOTE_S seconds (the queue never
  drained, e.g. under a steady interactive flood) feeds one line anyway, then waits again.

The count is JetStream's own (`num_pending` of the model's batch-class durable
`batch-tasks-<model>`: workers pull batch lines only into slack, fleet.worker.priority), read at
most every REFRESH_S; lines fed since the last read count as waiting until the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.bus.task_queue import TaskQueue
from fleet.wire import subjects

# Lines waiting on the batch subject delay no interactive or default task (workers pull them
# only into slack, fleet.worker.priority): enough wait to refill a worker's free slots in one
# pull, never so many that a job fills the queue.
LOW_WATER = 16
PROMOTE_S = 30.0
REFRESH_S = 0.02


def lines_to_feed(waiting: int, since_fed_s: float, low_water: int = LOW_WATER,
                  promote_s: float = PROMOTE_S) -> int:
    """How many lines may enter the queue now (pure)."""
    if waiting < low_water:
        return low_water - waiting
    return 1 if since_fed_s >= promote_s else 0


@dataclass
class _Model:
    waiting: int = 0
    read_at: float = float("-inf")
    fed_since_read: int = 0
    fed_at: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Slack:
    """The rule applied to every job a gateway runs (they share each model's low water)."""

    def __init__(self, queue: Callable[[], TaskQueue]) -> None:
        self.queue = queue  # the gateway's, over its current connection (its read budget)
        self.models: dict[str, _Model] = {}

    async def _waiting(self, model: str) -> int:
        info = await self.queue().durable(subjects.durable(model, "batch"))
        if info is None:
            return 0  # no worker has made the model's consumer yet: the queue decides
        return info.num_pending or 0

    async def room(self, model: str) -> None:
        """Returns when a line of `model` may be published (call once per line)."""
        state = self.models.setdefault(model, _Model())
        async with state.lock:
            while True:
                now = time.monotonic()
                if now - state.read_at >= REFRESH_S:
                    state.waiting, state.read_at = await self._waiting(model), now
                    state.fed_since_read = 0
                if lines_to_feed(state.waiting + state.fed_since_read, now - state.fed_at):
                    state.fed_since_read += 1
                    state.fed_at = now
                    return
                await asyncio.sleep(REFRESH_S)  # the next read of the queue's count
