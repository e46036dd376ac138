"""The dashboard's live feed: ONE reader per gateway process, shared by every browser tab.

KV watches mirror FLEET_NODES, FLEET_INSTANCES, FLEET_RUNNERS (while a tab is open: they
grow with the fleet) and the task owners of FLEET_TENANTS (fleet/bus/kv_mirror.py); the queue
counters are read once a second. Task events
fold into the recent-tasks table from the gateway's own feed (the events of its requests,
fleet.gateway.task_feed: no second subscription); only while a tab is open does the feed also
subscribe to `fleet.out.*`, to show the whole fleet's tasks to whoever watches. A gateway that
nobody watches hears no other gateway's tokens. Each open tab
is only an asyncio queue here, so a hundred tabs cost NATS nothing more than one.

Updates are coalesced: a change marks the fleet or a task dirty, and at most every
COALESCE_S one `fleet` snapshot (only if it draws differently) and one `task_rows` batch
go out. A burst of 1,000 tasks is a handful of messages per tab, not thousands, so a tab's
bounded queue does not overflow. A tab of a tenant gets only its own tasks; an operator's
(or any tab of an open gateway) gets all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from fleet.aio import Supervisor, started
from fleet.bus.kv_mirror import WAIT_CONNECTED_S, Mirror
from fleet.dashboard.model import RecentTasks, beats, changed, sees, snapshot
from fleet.errors import FleetError
from fleet.gateway.surface import TENANTS_BUCKET, Backend, record_of, task_key
from fleet.wire import subjects
from fleet.wire.base import Wire
from fleet.wire.cluster import Instance, NodeInfo, RunnerRecord
from fleet.wire.codec import DecodeError, decode_events, decode_model
from fleet.wire.events import OutputEvent, TokenChunk

log = logging.getLogger(__name__)

SAMPLE_S = 1.0  # the queue counters' read interval
COALESCE_S = 0.25  # the longest a change waits to be sent, with the others it gathered
HISTORY = 300  # samples of the queue counters: 5 minutes at one a second
TAB_QUEUE = 64  # messages a stalled tab may fall behind before it is dropped (it reconnects)
OWNERS_KEPT = 10_000  # task owners remembered; the table keeps 1,000 tasks


@dataclass(eq=False)
class Tab:
    tenant: str | None
    sees_all: bool
    queue: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(TAB_QUEUE))


def message(kind: str, data: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _decoded(mirror: Mirror, model: type[Wire], skipped: set[str]) -> list[dict[str, Any]]:
    """The values that decode as `model`, as the page reads them. Any other is left out (and
    logged once into `skipped`), as the gateway's catalogue does: one malformed record (a
    node card without its node_id) must not stop the feed of every tab."""
    values = []
    for key, raw in mirror.values.items():
        try:
            decode_model(model, raw)
        except DecodeError as exc:
            if f"{mirror.bucket}/{key}" not in skipped:
                skipped.add(f"{mirror.bucket}/{key}")
                log.warning("dashboard: ignoring %s in %s: %s", key, mirror.bucket, exc)
            continue
        values.append(orjson.loads(raw))
    return values


class Feed:
    """Latest fleet snapshot, queue history and recent tasks, pushed to every tab."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.fleet: dict[str, Any] | None = None
        self.beats: dict[str, dict[str, Any]] = {}
        self.queues: dict[str, dict[str, int]] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.tasks = RecentTasks()
        self.tabs: set[Tab] = set()
        self.sent: dict[str, int] = {}  # messages broadcast by kind (for tests and logs)
        self._due = asyncio.Event()
        self._fleet_dirty = False
        self._dirty_tasks: set[str] = set()
        self._tokens_this_tick = self._tasks_this_tick = 0
        self._node_tokens: Counter[str] = Counter()  # tokens made this tick, by node
        self.following = asyncio.Event()  # set while fleet.out.* is subscribed
        self._watched = asyncio.Event()  # set while a tab is open
        self._unwatched = asyncio.Event()  # set while none is
        self._unwatched.set()
        self._skipped: set[str] = set()  # bucket/key of records that did not decode
        self.nodes = Mirror(subjects.NODES_BUCKET, self._fleet_changed)
        self.instances = Mirror(subjects.INSTANCES_BUCKET, self._fleet_changed)
        self.runners = Mirror(subjects.RUNNERS_BUCKET, self._fleet_changed)
        self.owners = Mirror(TENANTS_BUCKET, self._owner_changed, keys=task_key(">"),
                             limit=OWNERS_KEPT)
        self.children: list[asyncio.Task[None]] = []  # its loops (for tests)

    def start(self, owner: Supervisor) -> None:
        """Its loops as children of `owner` (the gateway's lifespan, which stops them)."""
        hub = self.backend.hub
        if hasattr(hub, "tap"):  # the gateway's own tasks' events, as its requests read them
            hub.tap = self._from_gateway
        for mirror in (self.nodes, self.instances, self.runners):
            self.children.append(owner.forever(
                f"feed: watch {mirror.bucket}",
                lambda m=mirror: self._while_watched(m)))  # type: ignore[misc]
        self.children += [
            owner.forever(f"feed: watch {self.owners.bucket}",
                          lambda: self.owners.run(self.backend)),
            owner.forever("feed: queues", self._sample_queues),
            owner.forever("feed: tasks", self._follow_tasks),
            owner.forever("feed: flush", self._flush_forever),
        ]

    def _decoded(self, mirror: Mirror, model: type[Wire]) -> list[dict[str, Any]]:
        return _decoded(mirror, model, self._skipped)

    # --- what a tab gets -------------------------------------------------------------------

    def subscribe(self, tenant: str | None = None, sees_all: bool = True) -> Tab:
        tab = Tab(tenant, sees_all)
        self.tabs.add(tab)
        self._tabs_changed()
        if self.fleet is not None:
            tab.queue.put_nowait(message("fleet", self.fleet))
            tab.queue.put_nowait(message("beats", self.beats))  # fresher than the snapshot
        tab.queue.put_nowait(message("history", list(self.history)))
        tab.queue.put_nowait(message("tasks", self.tasks.listing(tenant, sees_all)))
        return tab

    def unsubscribe(self, tab: Tab) -> None:
        self.tabs.discard(tab)
        self._tabs_changed()

    def _tabs_changed(self) -> None:
        if self.tabs:
            self._unwatched.clear()
            self._watched.set()
        else:
            self._watched.clear()
            self._unwatched.set()

    def _send(self, tab: Tab, data: bytes) -> None:
        try:
            tab.queue.put_nowait(data)
        except asyncio.QueueFull:  # a stalled tab: it reconnects and starts afresh
            self.tabs.discard(tab)
            self._tabs_changed()

    def _broadcast(self, kind: str, data: Any) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1
        encoded = message(kind, data)
        for tab in list(self.tabs):
            self._send(tab, encoded)

    # --- changes, coalesced ----------------------------------------------------------------

    def _fleet_changed(self, key: str | None) -> None:
        self._fleet_dirty = True
        self._due.set()

    def _owner_changed(self, key: str | None) -> None:
        if key is None:  # the owners were read afresh: every row's owner may be known now
            self._dirty_tasks.update(self._adopt(row_id) for row_id in self.tasks.rows)
        elif (task_id := key.removeprefix(task_key(""))) in self.tasks.rows:
            self._dirty_tasks.add(self._adopt(task_id))
        self._due.set()

    def _adopt(self, task_id: str) -> str:
        value = self.owners.values.get(task_key(task_id))
        record = record_of(value, task_id) if value else None
        self.tasks.rows[task_id].tenant = record.tenant if record else None
        return task_id

    async def _flush_forever(self) -> None:
        while True:
            await self._due.wait()
            await asyncio.sleep(COALESCE_S)  # the coalescing window, not synchronisation
            self._due.clear()
            self.flush()

    def flush(self) -> None:
        if self._fleet_dirty and all(m.ready.is_set() for m in (
                self.nodes, self.instances, self.runners)):
            self._fleet_dirty = False
            current = snapshot(self._decoded(self.nodes, NodeInfo),
                               self._decoded(self.instances, Instance),
                               self._decoded(self.runners, RunnerRecord), self.queues,
                               time.time())
            if changed(self.fleet, current):
                self._broadcast("fleet", current)
            self.fleet = current
        if self._dirty_tasks:
            rows = [self.tasks.rows[i] for i in self._dirty_tasks if i in self.tasks.rows]
            self._dirty_tasks.clear()
            self.sent["task_rows"] = self.sent.get("task_rows", 0) + 1
            by_viewer: dict[tuple[str | None, bool], bytes] = {}
            for tab in list(self.tabs):
                viewer = (None, True) if tab.sees_all else (tab.tenant, False)
                if viewer not in by_viewer:
                    shown = [asdict(r) for r in rows if sees(r.tenant, *viewer)]
                    by_viewer[viewer] = message("task_rows", shown) if shown else b""
                if by_viewer[viewer]:
                    self._send(tab, by_viewer[viewer])

    # --- the readers -----------------------------------------------------------------------

    async def _connected(self) -> None:
        while not self.backend.connected:
            await asyncio.sleep(WAIT_CONNECTED_S)  # the backend retries its connection itself

    async def _sample_queues(self) -> None:
        await self._connected()
        while True:
            await self._sample()
            await asyncio.sleep(SAMPLE_S)  # the read interval, not synchronisation

    async def _sample(self) -> None:
        try:
            queues = {m: asdict(q) for m, q in (await self.backend.queue_stats()).items()}
        except (FleetError, NatsError, OSError, TimeoutError) as exc:
            log.warning("dashboard: could not read the queues: %s", exc)
            return
        now = time.time()
        sample = {"at": now, "queues": queues, "tasks": self._tasks_this_tick,
                  "tokens": self._tokens_this_tick, "node_tokens": dict(self._node_tokens)}
        self._tasks_this_tick = self._tokens_this_tick = 0
        self._node_tokens.clear()
        self.history.append(sample)
        self._broadcast("sample", sample)
        if queues != self.queues:  # the fleet snapshot lists the queues too
            self.queues = queues
            self._fleet_changed(None)
        if (current := beats(self._decoded(self.nodes, NodeInfo))) != self.beats:
            self.beats = current
            self._broadcast("beats", current)

    async def _while_watched(self, mirror: Mirror) -> None:
        """The fleet's state grows with the fleet (a heartbeat per node every 3 s): mirrored
        only while a tab is open, so a gateway nobody watches does not hear it for this."""
        while True:
            await self._watched.wait()
            watching = started(mirror.run(self.backend), "dashboard fleet mirror")
            try:
                while self.tabs and not watching.done():
                    gone = asyncio.create_task(self._unwatched.wait())
                    await asyncio.wait({watching, gone}, return_when=asyncio.FIRST_COMPLETED)
                    gone.cancel()
            finally:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
                mirror.ready.clear()  # stale from here on: read afresh by the next tab
            if not watching.cancelled() and (failure := watching.exception()) is not None:
                raise failure  # the supervisor logs it and starts this again

    def _from_gateway(self, data: bytes) -> None:
        if not self.following.is_set():  # else fleet.out.* brings it too
            self._fold(data)

    def _fold(self, data: bytes) -> None:
        try:
            events = decode_events(data)  # a terminal may carry its last tokens (issue 23)
        except DecodeError:
            return
        for event in events:
            self._fold_event(event)

    def _fold_event(self, event: OutputEvent) -> None:
        new = event.task_id not in self.tasks.rows
        if event.type == "task_accepted" and new:
            self._tasks_this_tick += 1
        if isinstance(event, TokenChunk):
            self._tokens_this_tick += event.count
            if not new:  # a token alone changes one counter: sent with the next change
                row = self.tasks.fold(event)
                if row.node:
                    self._node_tokens[row.node] += event.count
                return
        self.tasks.fold(event)
        self._dirty_tasks.add(self._adopt(event.task_id) if new else event.task_id)
        self._due.set()

    async def _follow_tasks(self) -> None:
        """Every task's events while a tab is open; none while nobody watches."""
        await self._connected()
        nc = self.backend.nc
        assert nc is not None

        async def on_event(msg: Msg) -> None:
            self._fold(msg.data)

        while True:
            await self._watched.wait()
            sub = await nc.subscribe(subjects.out("*"), cb=on_event)
            await nc.flush()  # the server has the subscription: events from now on arrive
            self.following.set()
            try:
                while self.tabs:  # a tab that came back meanwhile keeps the subscription
                    await self._unwatched.wait()
            finally:
                self.following.clear()
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
