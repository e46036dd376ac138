"""How the worker stops: hand back what has not started, let the runners stop, write what
they said last, wait for endings in flight, then leave the cluster and the connection.

A part of the worker (fleet.worker.main), composed, not mixed in: it is given the worker's
parts it stops, and asks the loop only what `StopDesk` says (the state, `apply`, `release`, and
`handle` for what still arrives while it waits).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from nats.aio.client import Client

from fleet import telemetry
from fleet.worker import state as ev
from fleet.worker.acks import AckPolicy, Stage
from fleet.worker.asks import AskResponder
from fleet.worker.cluster import ClusterLink
from fleet.worker.endings import Endings
from fleet.worker.handoff import HandOffs
from fleet.worker.inbox import (
    Fetched,
    HandedIn,
    ImageUploaded,
    Inbox,
    InboxItem,
    RunnerExited,
    RunnerReported,
    Stop,
    Tick,
)
from fleet.worker.outputs import TaskOutput
from fleet.worker.pulls import FETCH_WAIT_S, TaskPuller
from fleet.worker.runners import RunnerPool
from fleet.worker.spans import TaskSpans
from fleet.worker.state import WorkerState
from fleet.worker.uploads import ImageUploads

log = logging.getLogger(__name__)

SHUTDOWN_ENDINGS_S = 10.0


class StopDesk(Protocol):
    """What stopping asks of the worker's loop."""

    @property
    def state(self) -> WorkerState: ...

    def apply(self, event: ev.StateEvent) -> None: ...

    def release(self, task_id: str) -> None: ...

    async def handle(self, item: InboxItem) -> None: ...


class Stopping:
    def __init__(
        self, desk: StopDesk, *, nc: Client, inbox: Inbox, asks: AskResponder,
        uploads: ImageUploads, handoffs: HandOffs, acks: AckPolicy, spans: TaskSpans,
        endings: Endings, runners: RunnerPool, puller: TaskPuller, output: TaskOutput,
        cluster: ClusterLink,
    ) -> None:
        self.desk = desk
        self.nc = nc
        self.inbox = inbox
        self.asks = asks
        self.uploads = uploads
        self.handoffs = handoffs
        self.acks = acks
        self.spans = spans
        self.endings = endings
        self.runners = runners
        self.puller = puller
        self.output = output
        self.cluster = cluster

    @property
    def state(self) -> WorkerState:
        return self.desk.state

    async def shutdown(self) -> None:
        log.info("worker %s stopping", self.state.node_id)
        self.desk.apply(ev.Stopping())
        await self.asks.close()  # new asks go to the other workers
        await self.uploads.close()  # and new image uploads
        await self.handoffs.close()  # new offers find no responder: their senders run them
        await decline_queued_offers(self.inbox, self.handoffs)
        await self._end_pulls()
        for task_id, pending in list(self.state.pending.items()):  # not started here
            self.desk.release(task_id)
            self.desk.apply(ev.TaskEnded(task_id))
            msg = self.acks.release(task_id)
            if pending.handing_off is not None:  # another node may hold it: no verb here
                self.spans.settled(task_id, "hand_off_unanswered")
                continue
            self.spans.settled(task_id, "nak")  # another worker takes it now
            if msg is not None:
                self.endings.settle(task_id, msg, Stage.STOPPING_NOT_STARTED)
        await self.runners.stop_all(timeout=10.0)
        await self._drain_runner_reports()
        await self.endings.wait(SHUTDOWN_ENDINGS_S)
        for step in (self.puller.close, self.output.close, self.cluster.stop, telemetry.flush):
            try:
                await step()
            except Exception:  # each step is worth trying whatever became of the others
                log.exception("worker: shutdown step %s failed", step.__qualname__)


    async def _end_pulls(self) -> None:
        """Wait out the pulls still open at the server (each ends within FETCH_WAIT_S) and
        give back what they bring, and the intakes still running (their tasks are queued,
        then given back with the rest). Before any nak: a message nak'ed while a pull of ours
        is open would be redelivered into it, to a worker that is leaving, and sit to
        AckWait."""
        try:
            async with asyncio.timeout(FETCH_WAIT_S + 2.0):
                while self.state.pulling or self.state.receiving:
                    item = await self.inbox.get()
                    if isinstance(item, Fetched):
                        self.desk.apply(ev.PullEnded(item.model))
                        for msg in item.msgs:
                            self.endings.settle(None, msg, Stage.STOPPING_NOT_STARTED)
                    elif not isinstance(item, Stop | Tick):
                        await self.desk.handle(item)
        except TimeoutError:
            log.warning("stopping: pulls still open for %s, %d intake(s) unanswered",
                        sorted(self.state.pulling), len(self.state.receiving))

    async def _drain_runner_reports(self) -> None:
        """What the runners said while stopping (their last terminals) still goes out."""
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            log.debug("stopping: %s", item)
            if isinstance(item, RunnerReported | RunnerExited | ImageUploaded):
                try:
                    await self.desk.handle(item)
                except Exception:
                    log.exception("worker: a runner's last report was not handled")

    async def disconnect(self) -> None:
        try:
            await asyncio.wait_for(self.nc.drain(), 5.0)
        except Exception as exc:  # exiting anyway; the server drops what is left
            log.warning("connection not drained: %s: %s", type(exc).__name__, exc)


async def decline_queued_offers(inbox: Inbox, handoffs: HandOffs) -> None:
    """Offers already in the inbox are declined now, while their senders still wait (each then
    runs its task itself); everything else stays queued, in its order."""
    items = [inbox.get_nowait() for _ in range(inbox.qsize())]
    for item in items:
        if not isinstance(item, HandedIn):
            inbox.put_nowait(item)
    for item in items:
        if isinstance(item, HandedIn):
            await handoffs.answer(item.reply, False, "stopping")
