"""Deadlines in the broker, the worker's side: a task not started by its deadline expires
without a worker pulling it, and says so in its terminal event (`expired`, reason `deadline`).

The task's publisher set a sentinel whose per-message TTL ends at the deadline
(fleet.bus.deadlines); the server replaces it then with a delete marker. The workers share
one durable consumer of FLEET_DEADLINES: the worker that gets a marker claims the task id
(fleet.worker.claims); the claim succeeds only if no task message ever claimed it, i.e. the
task never started, and then that worker writes the expired terminal. A task that started
holds its claim, so its marker changes nothing; a task message pulled after the marker is
refused (`task_id_taken`) and never runs. A publisher that also sets `Nats-TTL` on the task
message (the gateway's batch lines do) has the broker drop the message itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext

from fleet.aio import started
from fleet.bus.deadlines import STREAM, expires, task_of
from fleet.bus.task_queue import durable_pull
from fleet.wire.events import ErrorReason
from fleet.worker.claims import Claims
from fleet.worker.janitor import Janitor
from fleet.worker.pulls import unsubscribe_pull

log = logging.getLogger(__name__)

DURABLE = "deadlines"


class DeadlineWatch:
    def __init__(self, nc: Client, js: JetStreamContext, janitor: Janitor) -> None:
        """`janitor`: writes the terminal (it publishes terminals the same way)."""
        self.nc = nc
        self.js = js
        self.janitor = janitor

    async def start(self) -> None:
        self.claims = await Claims.open(self.nc, self.js)
        self.markers = await durable_pull(self.js, STREAM, DURABLE,
                                          what="the deadline markers' consumer")
        self._loop = started(self._expire_forever(), "deadline watch")

    async def stop(self) -> None:
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop
        await unsubscribe_pull(self.markers)

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

