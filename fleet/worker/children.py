"""The worker's feeders: children of its Supervisor that do slow I/O beside the loop and
report to it only through the inbox - pulls, input fetches (bounded), the cancel listener and
the heartbeat tick."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleet.wire import subjects
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import Priority
from fleet.worker.acks import tick_every
from fleet.worker.cluster import ClusterLink
from fleet.worker.inbox import CancelSeen, Fetched, Inbox, InputsFailed, InputsFetched, Tick
from fleet.worker.pulls import TaskPuller
from fleet.worker.spans import TaskSpans

log = logging.getLogger(__name__)

INPUT_FETCHES = 4  # input downloads at once


class Feeds:
    def __init__(
        self, nc: Client, inbox: Inbox, puller: TaskPuller, cluster: ClusterLink,
        spans: TaskSpans, ack_wait_s: float,
    ) -> None:
        self.nc = nc
        self.inbox = inbox
        self.puller = puller
        self.cluster = cluster
        self.spans = spans
        self.ack_wait_s = ack_wait_s
        self._fetches = asyncio.Semaphore(INPUT_FETCHES)
        self._first_sub: Subscription | None = None
        self.cancel_sub: Subscription | None = None  # the one in use (tests drop it)

    async def subscribe_cancels(self) -> None:
        """Subscribe before the worker says it is ready, so no early cancel is missed."""
        self._first_sub = await self.nc.subscribe(subjects.cancel("*"))

    async def pull(
        self, model: str, batch: int, reserve: int = 0, only: Priority | None = None,
        interrupt: asyncio.Event | None = None,
    ) -> None:
        msgs: list[Msg] = []
        try:
            msgs = await self.puller.fetch(model, batch, reserve, only, interrupt)
        finally:  # always: the planner pulls again only after PullEnded
            self.inbox.put_nowait(Fetched(model, msgs, drained=len(msgs) < batch))

    async def fetch_inputs(self, task_id: str, hashes: tuple[str, ...]) -> None:
        try:
            async with self._fetches:
                with self.spans.child(task_id, "fetch inputs", {"fleet.images": len(hashes)}):
                    paths = await self.cluster.fetch_inputs(hashes)
        except Exception as exc:  # the loop ends the task with the reason
            reason = getattr(exc, "reason", ErrorReason.INTERNAL)
            self.inbox.put_nowait(InputsFailed(task_id, ErrorReason(reason), str(exc)))
            return
        self.inbox.put_nowait(InputsFetched(task_id, paths))

    async def follow_cancels(self) -> None:
        """Cancels for running tasks; a restart after a failure subscribes again."""
        sub = self._first_sub or await self.nc.subscribe(subjects.cancel("*"))
        self._first_sub = None
        self.cancel_sub = sub
        try:
            async for msg in sub.messages:
                self.inbox.put_nowait(CancelSeen(msg.subject.rsplit(".", 1)[-1]))
        finally:
            await _unsubscribe(sub)

    async def tick_forever(self) -> None:
        period = tick_every(self.ack_wait_s)
        while True:
            await asyncio.sleep(period)  # a timer, not synchronisation
            self.inbox.put_nowait(Tick())


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception as exc:  # already gone with its connection: nothing to undo
        log.debug("cancel subscription not unsubscribed: %s", exc)
