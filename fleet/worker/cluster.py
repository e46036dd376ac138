"""The worker's link to shared state: its node heartbeat, the instance table, runner records,
cancel records and the image store. Everything here is I/O the main loop delegates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.aio import Supervisor
from fleet.bus.connect import publish
from fleet.bus.kv_calls import open_bucket
from fleet.bus.objects import ObjectBucket
from fleet.bus.records import CancelRecords, InstanceRecords
from fleet.bus.vision_store import VisionShare
from fleet.bus.weights import MODELS_BUCKET, FleetModels
from fleet.config import Settings
from fleet.errors import ObjectCorrupt
from fleet.models.blas import openblas_available
from fleet.models.catalog import all_cards, builtin_cards
from fleet.models.disk import Held, held_models, room_for_models
from fleet.models.store import can_provide, fleet_fetching, models_on_disk
from fleet.placement_rules import memory_placed_on, models_placed_on
from fleet.wire import subjects
from fleet.wire.cluster import (
    Instance,
    ModelCard,
    NodeInfo,
    NodeJoined,
    NodeLeft,
    RunnerRecord,
    RunnerStatusChanged,
)
from fleet.wire.codec import DecodeError, decode_model
from fleet.wire.runners import RunnerReady, RunnerRunning, RunnerStatus
from fleet.worker.deathwatch import Probe, probe
from fleet.worker.demand import Demand
from fleet.worker.failover import Failover
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.inputs import ImageCache
from fleet.worker.janitor import DeadlineWatch, Janitor
from fleet.worker.node import free_port, node_id, node_info
from fleet.worker.state import (
    CardsChanged,
    InstancesChanged,
    RunnerView,
    peer_nodes,
    regrouped,
)
from fleet.worker.sweeper import FleetDuties

log = logging.getLogger(__name__)

STOP_BUDGET_S = 2.0  # saying goodbye to a broker that is down is not worth more
REMEMBERED_CANCELS = 100_000  # the bucket keeps an hour of them; a bound on memory all the same


# The statuses a runner reports as its tasks come and go (fleet.runner.machine: Running as
# it leaves Ready, then its count after each step that changed it; Ready once none remains).
BUSY_OR_IDLE = (RunnerReady, RunnerRunning)

# How often at most a runner's busy/idle flips are written while it flips. Each write is a KV
# put and a RunnerStatusChanged event, two sends that gave the core away: at light load a
# runner flipped twice a task (Running at its start, Ready at its end) and the last task's
# flips were written inside the next one's arrival -> accept (issue 23). Readers of runner
# records and events (the dashboard, `fleet instances`, the gateway's listing, tests and
# benches waiting for Ready) want the latest state, which is written at most this late.
FLIPS_EVERY_S = 0.05


def written_at(
    last: tuple[RunnerStatus, float] | None, status: RunnerStatus | None, now: float,
    every_s: float = FLIPS_EVERY_S,
) -> float:
    """Pure. When the status writer writes a runner's newest record of `status` (None: its
    removal), made at `now`, given the `last` record queued for that runner (its status and
    when, on the clock of `now`; None: none since the runner came or was removed). A
    busy/idle flip after a busy/idle record written less than `every_s` ago waits until
    `every_s` has passed; the newest record of the runner is written then (latest wins:
    those between are never written). Everything else is written at once: a removal, a
    lifecycle step (loading, shutting down, failed...), the first busy/idle record after
    one (the Ready a waiter watches for as a runner comes up), and the first flip of a
    runner quiet for `every_s`."""
    if status is None or last is None:
        return now
    last_status, last_at = last
    if not (isinstance(status, BUSY_OR_IDLE) and isinstance(last_status, BUSY_OR_IDLE)):
        return now
    return max(now, last_at + every_s)


def same_state(record: RunnerRecord, last: RunnerRecord) -> bool:
    """Pure. Whether a held flip's `record` says what `last` (the runner's last record
    queued) said, but for its time: then it is not written (a runner that flipped and
    flipped back between two writes)."""
    return record.model_copy(update={"at": last.at}) == last


class ClusterLink:
    def __init__(
        self, settings: Settings, nc: Client, js: JetStreamContext, inbox: asyncio.Queue[Any]
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.js = js
        self.inbox = inbox
        self.node_id = node_id(settings.data_dir)
        self.cards = all_cards(settings.data_dir)
        # Checked once: whether a model can be built here does not change while we run.
        self.buildable = [
            model for model, card in self.cards.items() if can_provide(card, settings.models_dir)
        ]
        # Runners load it; the worker itself does no maths and should start no BLAS threads.
        self.blas = openblas_available()
        self.started_at = time.time()
        port = settings.ring_port or free_port(settings.ring_host)
        self.ring_address = f"{settings.ring_host}:{port}"
        self.records: dict[str, RunnerRecord] = {}
        self.placed: dict[str, Instance] = {}  # the instance table as last watched
        # The status writer's work, in order: a runner's record (None: its removal).
        self._status_writes: asyncio.Queue[tuple[str, RunnerRecord | None]] = asyncio.Queue()
        # Runner id -> the record last queued for the writer and when (the loop's clock).
        self._written: dict[str, tuple[RunnerRecord, float]] = {}
        # Runner id -> its newest busy/idle flip held (`written_at`), and the timer that
        # queues it when due; latest wins.
        self._held: dict[str, tuple[RunnerRecord, asyncio.TimerHandle]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._own_supervisor: Supervisor | None = None
        self.cancelled: dict[str, None] = {}  # cancel records seen, oldest first
        self._cancels_loaded = False
        # What the models dir holds, scanned when a model comes or goes (not per heartbeat).
        self.on_disk: set[str] = set()
        self.held: list[Held] = []
        # Whether a warm standby runner waits here (set by the RunnerPool, which holds it).
        self.standby_warm: Callable[[], bool] = lambda: False

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Register this node and start its loops as children of `supervisor` (each restarted
        with backoff if it fails). Without one, the link owns a supervisor of its own."""
        if supervisor is None:
            self._own_supervisor = supervisor = Supervisor("cluster")
            await supervisor.__aenter__()
        self.nodes = await self._bucket(subjects.NODES_BUCKET)
        self.instances = await self._bucket(subjects.INSTANCES_BUCKET)
        self.runners = await self._bucket(subjects.RUNNERS_BUCKET)
        self.cancels = await CancelRecords.open(self.js)
        self.store = ObjectBucket(self.nc, subjects.IMAGES_BUCKET)
        self.fleet_models = FleetModels(self.nc, self.js)
        await self._load_fleet_models()
        await self.rescan_models()
        self.cache = ImageCache(self.settings.images_dir, self.settings.image_cache_bytes)
        self.vision = VisionShare(self.nc, self.settings.images_dir)  # the vision cache's store
        self.heartbeat = Heartbeat(
            self.nc, self.nodes, self.runners, self.node_id, self._node_info,
            lambda: list(self.records.values()),
        )
        await self.heartbeat.read_ttl(self.js)
        self.failover = Failover(
            self.js, self.nodes, self.instances, self.cards, self_id=self.node_id,
            trusted=self.heartbeat.trusts_absences, on_own_key_gone=self.heartbeat.wake.set,
            on_gap=self.heartbeat.gap,
        )
        self.demand = Demand(
            self.js, self.instances, self.cards, placed=lambda: self.placed.values(),
            live_nodes=lambda: self.failover.live.values(), slots=self.settings.slots,
            nodes_known=self.failover.loaded,
        )
        on_known = self.demand.want if self.settings.auto_place else None
        self.janitor = Janitor(self.nc, self.js, self._is_known, on_known=on_known)
        await self.janitor.start()
        self.deadlines = DeadlineWatch(self.nc, self.js, self.janitor)  # issue 25
        await self.deadlines.start()
        # Heartbeats are watched, dead nodes swept, demand placed and tasks of unknown models
        # answered by one worker of the fleet at a time: the holder of the sweeper lease.
        self.duties = FleetDuties(self.js, self.node_id, self.failover,
                                  self.demand if self.settings.auto_place else None,
                                  self.janitor, nc=self.nc,
                                  link_since=lambda: self.heartbeat.health.ok_since)
        await self.heartbeat.beat(budget_s=30.0)
        await publish(self.nc, subjects.node_event(self.node_id), NodeJoined(
            node_id=self.node_id, hostname=node_info(self.node_id, 0, [], [], None).hostname,
            at=time.time(),
        ))
        if self.blas:
            log.info("BLAS: %s loaded for mlx's CPU path", self.blas)
        self._tasks = [
            supervisor.forever("heartbeat", self.heartbeat.forever),
            supervisor.forever("instance watch", self._watch_instances),
            supervisor.forever("status writer", self._write_statuses_forever),
            supervisor.forever("cancel watch", self._watch_cancels),
            supervisor.forever("fleet-wide duties", self.duties.forever),
            supervisor.forever("model cards watch", self._watch_models),
        ]

    async def _bucket(self, name: str) -> KeyValue:
        return await open_bucket(self.js, name)

    def _is_known(self, model: str) -> bool:
        return model in self.cards or any(i.model == model for i in self.placed.values())

    async def stop(self) -> None:
        await self.deadlines.stop()
        await self.janitor.stop()
        # The runners' last statuses (shut down, removed) are worth the wait; a dead broker is not.
        self._release_all()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._status_writes.join(), 5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_supervisor is not None:
            await self._own_supervisor.__aexit__(None, None, None)
            self._own_supervisor = None
        # Deleting our key tells the others at once that we left on purpose.
        with contextlib.suppress(Exception):
            await self.heartbeat.node_records.delete(self.node_id, budget_s=STOP_BUDGET_S)
            await publish(
                self.nc, subjects.node_event(self.node_id),
                NodeLeft(node_id=self.node_id, at=time.time()),
            )

    # ---- heartbeat and instances -------------------------------------------------------

    def _node_info(self) -> NodeInfo:
        fetchable = [
            model for model, card in self.cards.items()
            if card.manifest is not None and fleet_fetching()
        ]
        available = sorted({*self.buildable, *self.on_disk, *fetchable})
        limit = self.settings.models_disk_limit
        room = room_for_models(self.held, self.models_placed_here(), limit)
        return node_info(
            self.node_id, self.started_at, sorted(self.on_disk), sorted(self.records), self.blas,
            available, room, memory_limit=self.settings.memory_limit,
            memory_placed=self.memory_placed_here(), ring_address=self.ring_address,
            standby_runner=self.standby_warm(),
        )

    async def restart_group(self, instance_id: str, layout: tuple[object, ...]) -> None:
        """A rank of this sharded instance died: bump its generation (a compare-and-set), so
        every rank's worker restarts its runner into a fresh ring. A moved or already bumped
        instance is left alone: its runners restart anyway."""
        records = InstanceRecords(self.instances)
        if (stored := await records.get(instance_id)) is None:
            return
        instance, revision = stored
        bumped = regrouped(instance, layout)
        if bumped is None:
            return
        if await records.update(bumped, revision):
            log.warning("a rank of %s died: its group restarts (generation %d)", instance_id,
                        bumped.generation)

    async def gone_peers(self, layout: tuple[object, ...]) -> list[str]:
        """The nodes of a group's other ranks whose worker is gone: no subscription on its
        alive subject, the death watch's own evidence, seen at once when a worker's process
        died (its connection closed). A silent node (paused, slow) is not gone."""
        nodes = peer_nodes(layout, self.node_id)
        probes = await asyncio.gather(*(probe(self.nc, node) for node in nodes))
        return [node for node, seen in zip(nodes, probes, strict=True)
                if seen is Probe.NO_RESPONDERS]

    def memory_placed_here(self) -> int:
        """What the shards placed on this node take (fleet.placement_rules)."""
        return memory_placed_on(self.node_id, self.placed.values(), self.cards)

    def models_placed_here(self) -> set[str]:
        return models_placed_on(self.node_id, self.placed.values())

    async def rescan_models(self) -> None:
        """Read the models dir again (after a fetch, a build or an eviction)."""
        models_dir = self.settings.models_dir
        cards = dict(self.cards)

        def scan() -> tuple[set[str], list[Held]]:
            # Fetched models are directories named by id, whether or not a local card names
            # them; a local card's own path counts too.
            on_disk = set(models_on_disk(models_dir)) | {
                model for model in cards if (models_dir / model).is_dir()
            }
            return on_disk, held_models(models_dir)

        self.on_disk, self.held = await asyncio.to_thread(scan)

    # ---- the fleet's model cards ---------------------------------------------------------

    async def _load_fleet_models(self) -> None:
        """Write the built-in cards the fleet lacks, then take in every card of the fleet (a
        model added on another machine is servable here by fetching its files)."""
        await self.fleet_models.ensure_cards(builtin_cards())
        self.cards.update(await self.fleet_models.all())

    async def _watch_models(self) -> None:
        kv = await self.fleet_models.kv()
        watcher = await kv.watchall()
        async for entry in watcher:
            if entry is None or entry.operation in ("DEL", "PURGE") or not entry.value:
                continue  # a removed card stays known until restart: placed runners keep it
            try:
                card = decode_model(ModelCard, entry.value)
            except DecodeError as exc:
                log.warning("ignoring model card %s in %s: %s", entry.key, MODELS_BUCKET, exc)
                continue
            self.cards[card.id] = card  # in place: Demand and Failover share this dict
            # The loop's state takes a snapshot, changed only by apply.
            await self.inbox.put(CardsChanged(dict(self.cards)))

    async def _watch_instances(self) -> None:
        table: dict[str, Instance] = {}
        watcher = await self.instances.watchall()
        async for entry in watcher:
            if entry is None:  # end of the initial values
                self.placed = dict(table)
                await self.inbox.put(InstancesChanged(dict(table)))
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                table.pop(entry.key, None)
            else:
                try:
                    table[entry.key] = decode_model(Instance, entry.value)
                except DecodeError as exc:
                    log.warning("ignoring instance %s: %s", entry.key, exc)
                    continue
            self.placed = dict(table)
            await self.inbox.put(InstancesChanged(dict(table)))

    # ---- runners ------------------------------------------------------------------------

    def runner_status(self, view: RunnerView | None, status: RunnerStatus) -> None:
        """Record a runner's new status. Written by one ordered writer off the task path, so
        a task's first event never waits for a KV round trip; its busy/idle flips at most
        every FLIPS_EVERY_S (`written_at`)."""
        if view is None:
            return
        now = time.time()
        record = RunnerRecord(
            runner_id=view.runner_id, instance_id=view.instance_id, node_id=self.node_id,
            model=view.model, status=status, slots=view.slots,
            active_tasks=len(view.in_flight), rank=view.rank, at=now,
        )
        self.records[view.runner_id] = record
        self._queue_status(view.runner_id, record)

    def runner_removed(self, runner_id: str) -> None:
        self.records.pop(runner_id, None)
        self._queue_status(runner_id, None)

    def _queue_status(self, runner_id: str, record: RunnerRecord | None) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        last = self._written.get(runner_id)
        at = written_at(None if last is None else (last[0].status, last[1]),
                        None if record is None else record.status, now)
        held = self._held.pop(runner_id, None)
        if at > now and record is not None:
            # Its timer (the one there, else a new one) queues the newest when due.
            timer = held[1] if held is not None else loop.call_at(at, self._release, runner_id)
            self._held[runner_id] = record, timer
            return
        if held is not None:
            held[1].cancel()  # this record is newer than the flip held
        self._queue(runner_id, record, now)

    def _queue(self, runner_id: str, record: RunnerRecord | None, now: float) -> None:
        if record is None:
            self._written.pop(runner_id, None)
        else:
            self._written[runner_id] = record, now
        self._status_writes.put_nowait((runner_id, record))

    def _release(self, runner_id: str) -> None:
        """A runner's held flip is due: written unless it says what the last record said."""
        record, _ = self._held.pop(runner_id)
        last = self._written.get(runner_id)
        if last is None or not same_state(record, last[0]):
            self._queue(runner_id, record, asyncio.get_running_loop().time())

    def _release_all(self) -> None:
        for _, timer in self._held.values():
            timer.cancel()
        for runner_id in list(self._held):
            self._release(runner_id)

    async def _write_statuses_forever(self) -> None:
        while True:
            runner_id, record = await self._status_writes.get()
            try:
                if record is None:
                    await self.heartbeat.runner_records.delete(runner_id)
                else:
                    await self.heartbeat.put_runner(record)
                    changed = RunnerStatusChanged(
                        runner_id=runner_id, instance_id=record.instance_id,
                        node_id=self.node_id, model=record.model, status=record.status,
                        at=record.at,
                    )
                    await publish(self.nc, subjects.runner_event(self.node_id, runner_id), changed)
            except Exception as exc:
                log.warning("runner status of %s not written: %s", runner_id, exc)
            finally:
                self._status_writes.task_done()

    # ---- tasks ---------------------------------------------------------------------------

    async def _watch_cancels(self) -> None:
        """Follow FLEET_CANCELS so that deciding 'cancelled before it started' costs no round
        trip per task. A record that lands while its task is being dispatched is still caught:
        the cancel message on `fleet.cancel.<id>` reaches the running task."""
        try:
            watcher = await self.cancels.kv.watchall()
            async for entry in watcher:
                if entry is None:
                    self._cancels_loaded = True
                elif entry.value:
                    self.remember_cancel(entry.key)
        finally:
            # Stale from here on (the supervisor restarts this watch): ask the bucket per task.
            self._cancels_loaded = False

    def remember_cancel(self, task_id: str) -> None:
        self.cancelled[task_id] = None
        if len(self.cancelled) > REMEMBERED_CANCELS:
            del self.cancelled[next(iter(self.cancelled))]

    async def is_cancelled(self, task_id: str) -> bool:
        if task_id in self.cancelled:
            return True
        if self._cancels_loaded:
            return False
        return await self.cancels.cancelled(task_id)

    async def fetch_inputs(self, hashes: tuple[str, ...]) -> dict[str, Path]:
        """Local paths of a task's input images, pinned until `release_inputs`."""
        # Features another node encoded, if any, read beside the images (one after the other
        # they were two store round trips before every dispatch of a vision task). The
        # prefetch is bounded (PREFETCH_S) and logs its own failures; it ends with this call.
        features = asyncio.create_task(self.vision.prefetch(hashes))
        try:
            paths = await self.cache.ensure(hashes, self.store, self.settings.input_wait_s)
        except BaseException:
            features.cancel()
            raise
        await features
        return paths

    def release_inputs(self, hashes: list[str]) -> None:
        self.cache.release(hashes)
        self.vision.share(hashes)  # features this node encoded for them, once each

    async def upload_output(self, sha256: str) -> None:
        """A runner wrote an image into the cache dir; store it by hash (never re-put).
        Pinned meanwhile: a fetch for another task could otherwise evict it mid-upload."""
        self.cache.pin([sha256])
        try:
            await self.store.put_by_hash(self.cache.adopt(sha256), sha256=sha256)
        except ObjectCorrupt:
            self.cache.discard(sha256)  # no later task may trust it
            raise
        finally:
            self.cache.release([sha256])
