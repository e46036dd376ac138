"""The dashboard's live feed: ONE reader per gateway process, shared by every browser tab.

It reads the fleet's KV buckets (FLEET_NODES, FLEET_INSTANCES, FLEET_RUNNERS) and the queue
counts once a second, and follows `fleet.out.>` for the recent-tasks table; each open tab is
only an asyncio queue here, so a hundred tabs cost NATS nothing more than one. A snapshot is
read rather than a KV watch kept because a node leaves FLEET_NODES by its key's TTL, and a
fresh snapshot is the one view that sees that the same way `fleet nodes` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict
from typing import Any

import orjson
from nats.aio.msg import Msg

from fleet.aio import Supervisor
from fleet.bus.kv_read import live_entries
from fleet.dashboard.model import RecentTasks, changed, snapshot
from fleet.errors import FleetError
from fleet.gateway.backend import Backend
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
HISTORY = 300  # samples of the queue counters: 5 minutes at one a second
WAIT_CONNECTED_S = 0.5


async def _bucket(backend: Backend, name: str) -> list[dict[str, Any]]:
    values = []
    for entry in await live_entries(backend.jetstream(), name, budget_s=5.0):
        with contextlib.suppress(orjson.JSONDecodeError):
            values.append(orjson.loads(entry.value))
    return values


CLOSE_WAIT_S = 5.0


class Feed:
    """Latest fleet snapshot, queue history and recent tasks, pushed to every subscriber."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.fleet: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.tasks = RecentTasks()
        self.subscribers: set[asyncio.Queue[bytes]] = set()
        self._supervisor: Supervisor | None = None
        self._owner: asyncio.Task[None] | None = None
        self._tokens_this_tick = 0
        self._tasks_this_tick = 0

    async def start(self) -> None:
        # The supervisor lives in a task of its own: a TaskGroup is entered and left by the
        # same task, and the app's lifespan may run its start and its end in different ones.
        started = asyncio.Event()
        self._owner = asyncio.create_task(self._own(started), name="dashboard-feed")
        self._owner.add_done_callback(_log_failure)
        await started.wait()

    async def _own(self, started: asyncio.Event) -> None:
        async with Supervisor("dashboard-feed") as supervisor:
            self._supervisor = supervisor
            supervisor.forever("fleet", self._read_fleet)
            supervisor.forever("tasks", self._follow_tasks)
            started.set()
            await asyncio.Event().wait()  # until close() cancels it

    async def close(self) -> None:
        if self._owner is not None:
            self._owner.cancel()
            # Bounded: a child inside a nats-py call can swallow the cancel (seen hanging a
            # gateway's shutdown with no NATS); the app must still stop.
            done, _ = await asyncio.wait({self._owner}, timeout=CLOSE_WAIT_S)
            if not done:
                log.warning("dashboard feed did not stop within %.0f s; left behind",
                            CLOSE_WAIT_S)

    # --- what a tab gets -------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)
        self.subscribers.add(queue)
        if self.fleet is not None:
            queue.put_nowait(self._message("fleet", self.fleet))
        queue.put_nowait(self._message("history", list(self.history)))
        queue.put_nowait(self._message("tasks", self.tasks.listing()))
        return queue

    def unsubscribe(self, queue: asyncio.Queue[bytes]) -> None:
        self.subscribers.discard(queue)

    @staticmethod
    def _message(kind: str, data: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _broadcast(self, kind: str, data: Any) -> None:
        message = self._message(kind, data)
        for queue in list(self.subscribers):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:  # a stalled tab: it reconnects and starts afresh
                self.subscribers.discard(queue)

    # --- the readers -----------------------------------------------------------------------

    async def _connected(self) -> None:
        while not self.backend.connected:
            await asyncio.sleep(WAIT_CONNECTED_S)  # the backend retries its connection itself

    async def _read_fleet(self) -> None:
        await self._connected()
        while True:
            await self._tick()
            await asyncio.sleep(INTERVAL_S)  # the read interval, not synchronisation

    async def _tick(self) -> None:
        try:
            nodes = await _bucket(self.backend, subjects.NODES_BUCKET)
            instances = await _bucket(self.backend, subjects.INSTANCES_BUCKET)
            runners = await _bucket(self.backend, subjects.RUNNERS_BUCKET)
            queues = {m: asdict(q) for m, q in (await self.backend.queue_stats()).items()}
        except (FleetError, OSError, TimeoutError) as exc:
            log.warning("dashboard: could not read the fleet: %s", exc)
            return
        now = time.time()
        current = snapshot(nodes, instances, runners, queues, now)
        sample = {"at": now, "queues": queues, "tasks": self._tasks_this_tick,
                  "tokens": self._tokens_this_tick}
        self._tasks_this_tick = self._tokens_this_tick = 0
        self.history.append(sample)
        self._broadcast("sample", sample)
        if changed(self.fleet, current):
            self._broadcast("fleet", current)
        self.fleet = current

    async def _follow_tasks(self) -> None:
        await self._connected()
        nc = self.backend.nc
        assert nc is not None
        done = asyncio.Event()

        async def on_event(msg: Msg) -> None:
            try:
                event = decode_event(msg.data)
            except DecodeError:
                return
            if event.type == "task_accepted" and event.task_id not in self.tasks.rows:
                self._tasks_this_tick += 1
            if event.type == "token":
                self._tokens_this_tick += 1
                if event.task_id in self.tasks.rows:  # a token alone changes one counter
                    self.tasks.fold(event)
                    return
            row = self.tasks.fold(event)
            self._broadcast("task", asdict(row))

        sub = await nc.subscribe(subjects.out("*"), cb=on_event)
        try:
            await done.wait()  # until cancelled with the feed
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


def _log_failure(task: asyncio.Task[None]) -> None:
    """The feed's owner ends only by close(); any other end is a failure someone must hear."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("dashboard feed stopped", exc_info=exc)
