"""The runner subprocesses this node hosts: prepare a model, spawn, command, stop.

Preparing a model: weights already here are used as they are; else, when the fleet holds the
model's files (a card with a manifest in FLEET_MODELS), they are fetched into the data dir,
the node showing a `downloading` runner record meanwhile (no runner process exists then, so
nothing can be dispatched to it); else a built-in model is built here. A built-in model this
node has and the fleet lacks is published, so that the next node fetches it.

A runner's environment: R runners on one machine each running OpenBLAS with a thread per core
oversubscribe it R times over (on this 2-core box two runners with 2 threads each decode
slower than with 1). So a runner gets the node's cores divided by the runners it hosts, at
least one, unless the operator set OPENBLAS_NUM_THREADS for the worker, which then holds for
every runner (`runner_env`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.aio import Supervisor
from fleet.bus.weights import fetch_failure
from fleet.config import Settings
from fleet.models.disk import make_room, touch
from fleet.models.store import BUILDERS, ensure_model, fleet_fetching, local_model_dir
from fleet.wire.cluster import Instance, ModelCard
from fleet.wire.pipe import RunnerCommand, RunnerSpec
from fleet.wire.ring import GroupSpec
from fleet.wire.runners import RunnerDownloading, RunnerFailed
from fleet.worker.inbox import Inbox, RunnerExited
from fleet.worker.standby import (
    StandbyRunner,
    runners_starting,
    standby_fits,
    standby_kept,
    standby_may_start,
)
from fleet.worker.state import (
    RunnerSpawned,
    RunnerStartFailed,
    RunnerView,
    WorkerState,
    group_layout,
)
from fleet.worker.supervisor import RunnerNotRunning, RunnerProcess

if TYPE_CHECKING:
    from fleet.worker.cluster import ClusterLink

log = logging.getLogger(__name__)

# mflux draws a tqdm progress bar per generation: carriage-return noise in the runner's log.
BASE_ENV = {"TQDM_DISABLE": "1"}


def blas_threads(cores: int, runners: int, configured: str | None) -> str:
    """OPENBLAS_NUM_THREADS for one of `runners` runners on `cores` cores. Pure."""
    if configured:
        return configured
    return str(max(1, cores // max(1, runners)))


def runner_env(runners_here: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    threads = blas_threads(os.cpu_count() or 1, runners_here, environ.get("OPENBLAS_NUM_THREADS"))
    return {**BASE_ENV, "OPENBLAS_NUM_THREADS": threads}

PROGRESS_EVERY_S = 0.5  # how often a fetch's progress is written to FLEET_RUNNERS
RING_CONNECT_S = 120.0  # a shard's peers may be fetching or building the model meanwhile



def group_spec(instance: Instance, node_id: str) -> GroupSpec | None:
    """This node's place in a sharded instance's ring; None for a one-node instance. Pure."""
    if not instance.sharded:
        return None
    shard = instance.shard_on(node_id)
    if shard is None:
        raise LookupError(f"{instance.instance_id} has no shard on {node_id}")
    ranks = sorted(instance.shards, key=lambda s: s.rank)
    ring = [s.ring_address for s in ranks]
    if [s.rank for s in ranks] != list(range(len(ranks))) or None in ring:
        raise ValueError(f"{instance.instance_id}: its shards do not form a ring: "
                         f"{[(s.rank, s.ring_address) for s in ranks]}")
    return GroupSpec(
        rank=shard.rank, start_layer=shard.start_layer, end_layer=shard.end_layer,
        ring=[address for address in ring if address], connect_timeout_s=RING_CONNECT_S,
    )


class RunnerPool:
    """The runners of this node. Starting, stopping and each runner's report pump are
    children of the worker's Supervisor (`owner`)."""

    def __init__(
        self, settings: Settings, node_id: str, inbox: Inbox, owner: Supervisor,
        cluster: ClusterLink | None = None,
    ) -> None:
        self.settings = settings
        self.cluster = cluster  # None: no fleet fetch nor publish (unit tests)
        self.node_id = node_id
        self.inbox = inbox
        self.owner = owner
        self.processes: dict[str, RunnerProcess] = {}
        self.stopping: set[str] = set()
        self.building = asyncio.Lock()
        self.standby: StandbyRunner | None = None  # fleet.worker.standby
        self._standby_busy = False  # a standby's start or discard is under way
        self._standby_broken = False  # one ended by itself: its imports fail here
        # Monotonic: when a runner here was last seen starting. The worker's own start counts:
        # a model placed in its first seconds (every test, `fleet up`) starts a runner anyway,
        # and a standby imported beside it would take its cores, then go unused.
        self._last_starting = time.monotonic()
        if cluster is not None:
            cluster.standby_warm = lambda: self.standby is not None and self.standby.warm

    def spawn(self, instance: Instance, card: ModelCard | None) -> None:
        """Prepare weights (a first SmolLM2 conversion takes seconds) off the loop, then start."""
        self.owner.spawn(f"start runner for {instance.instance_id}", self._spawn(instance, card))

    async def _spawn(self, instance: Instance, card: ModelCard | None) -> None:
        try:
            if card is None:
                raise LookupError(f"no model card {instance.model!r} on this node")
            group = group_spec(instance, self.node_id)
            path = await self._prepare(instance, card)
            standby = self._take_standby(card)
            runner_id = standby.runner_id if standby else f"run-{uuid.uuid4().hex[:10]}"
            slots = 1 if card.is_image else instance.slots
            spec = RunnerSpec(
                runner_id=runner_id, instance_id=instance.instance_id, node_id=self.node_id,
                card=card, model_path=str(path), images_dir=str(self.settings.images_dir),
                slots=slots, group=group,
            )
            self.settings.images_dir.mkdir(parents=True, exist_ok=True)
            logs = self.settings.data_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            process = RunnerProcess(
                spec, self.inbox, env=runner_env(self._runners_here(instance))
                # read by a vision runner (fleet/runner/vision_cache.py)
                | {"FLEET_VISION_CACHE_MB": str(self.settings.vision_cache_mb)},
                log_path=logs / f"{runner_id}.log",
            )
            await process.start(self.owner, standby)
        except Exception as exc:
            log.error("cannot start a runner for %s: %s", instance.instance_id, exc)
            self.inbox.put_nowait(RunnerStartFailed(instance.instance_id, time.time()))
            return
        self.processes[runner_id] = process
        view = RunnerView(
            runner_id=runner_id, instance_id=instance.instance_id, model=instance.model,
            slots=slots, rank=group.rank if group else 0, layout=group_layout(instance),
        )
        self.inbox.put_nowait(RunnerSpawned(view))

    def _take_standby(self, card: ModelCard) -> StandbyRunner | None:
        standby = self.standby
        if standby is None or not standby.alive or not standby_fits(card):
            return None
        self.standby = None
        return standby

    def tend_standby(self, state: WorkerState) -> None:
        """Start a standby runner when this node wants one and holds none; drop one it no
        longer wants (fleet.worker.standby decides). Called after every change of state."""
        now = time.monotonic()
        if runners_starting(state):
            self._last_starting = now
        if not self.settings.standby_runner or self._standby_busy:
            return
        standby = self.standby
        if standby is not None and not standby.alive:
            log.warning("standby runner %s ended by itself (see its log): no more standbys "
                        "on this node", standby.runner_id)
            self._standby_broken = True
        if standby is not None and (not standby.alive or not standby_kept(state)):
            self.standby = None
            self._standby_busy = True
            self.owner.spawn(f"discard standby {standby.runner_id}", self._discard(standby))
        elif standby is None and not self._standby_broken and standby_may_start(
                state, now - self._last_starting):
            self._standby_busy = True
            threads = runner_env(max(1, len(state.hosted_instances())))
            self.owner.spawn("start a standby runner", self._start_standby(threads))

    async def _start_standby(self, env: dict[str, str]) -> None:
        try:
            self.standby = await StandbyRunner.start(self.settings.data_dir / "logs", env,
                                                     self.owner, on_warm=self._standby_warm)
        except Exception as exc:
            log.warning("no standby runner: %s", exc)
            self._standby_broken = True
        finally:
            self._standby_busy = False

    def _standby_warm(self) -> None:
        if self.cluster is not None:  # heartbeat now: `fleet nodes` and tests see it
            self.cluster.heartbeat.wake.set()

    async def _discard(self, standby: StandbyRunner) -> None:
        try:
            await standby.discard()
        finally:
            self._standby_busy = False

    def _runners_here(self, instance: Instance) -> int:
        """How many runners this node hosts once `instance`'s runs (its BLAS share)."""
        if self.cluster is None:
            return 1
        here = {i.instance_id for i in self.cluster.placed.values()
                if any(s.node_id == self.node_id for s in i.shards)}
        return len(here | {instance.instance_id})

    async def _prepare(self, instance: Instance, card: ModelCard) -> Path:
        try:
            return await self._find_or_make(instance, card)
        finally:
            if self.cluster is not None:  # a model came (or others were evicted)
                await self.cluster.rescan_models()

    async def _find_or_make(self, instance: Instance, card: ModelCard) -> Path:
        models_dir = self.settings.models_dir
        local = await asyncio.to_thread(local_model_dir, card, models_dir)
        if local is not None:
            touch(local, models_dir)
        fleet = self.cluster.fleet_models if self.cluster is not None else None
        if local is None and fleet is not None and fleet_fetching():
            published = await fleet.get(card.id)
            if published is not None and published.manifest is not None:
                return await self._fetch(instance, published)
        # One build at a time: builds saturate the cores anyway, and the libraries they
        # import lazily (transformers) are not safe to import from two threads at once.
        async with self.building:
            path = await asyncio.to_thread(ensure_model, card, models_dir)
        if fleet is not None and card.source == "built-in" and card.id in BUILDERS:
            self.owner.spawn(f"publish {card.id}", self._publish_if_absent(card, path))
        return path

    async def _fetch(self, instance: Instance, card: ModelCard) -> Path:
        assert self.cluster is not None and self.cluster.fleet_models is not None
        cluster = self.cluster
        view = RunnerView(
            runner_id=f"fetch-{instance.instance_id}"[:64], instance_id=instance.instance_id,
            model=instance.model, slots=instance.slots,
        )
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done >= total:
                last[0] = now
                cluster.runner_status(view, RunnerDownloading(bytes_done=done, bytes_total=total))

        models_dir = self.settings.models_dir
        needed = card.manifest.total_bytes if card.manifest else 0
        evicted = await asyncio.to_thread(
            make_room, models_dir, card.id, needed, cluster.models_placed_here(),
            self.settings.models_disk_limit,
        )
        if evicted:
            log.info("evicted %s to make room for %s", ", ".join(evicted), card.id)
        try:
            path = await cluster.fleet_models.fetch(card, models_dir, progress)
        except Exception as exc:
            # Written once, not refreshed: `fleet instances list` shows why until the next try
            # replaces it (the start backoff's cap is FLEET_RUNNERS' max age, 60 s), rather
            # than the download's last progress.
            cluster.runner_status(view, RunnerFailed(error=fetch_failure(card.id, exc)))
            cluster.records.pop(view.runner_id, None)
            raise
        except BaseException:  # cancelled (the worker stops): nothing to show
            cluster.runner_removed(view.runner_id)
            raise
        cluster.runner_removed(view.runner_id)
        return path

    async def _publish_if_absent(self, card: ModelCard, path: Path) -> None:
        assert self.cluster is not None and self.cluster.fleet_models is not None
        fleet = self.cluster.fleet_models
        published = await fleet.get(card.id)
        if published is not None and published.manifest is not None:
            return
        try:
            await fleet.publish(published or card, path)
        except Exception as exc:
            log.warning("could not publish %s to the fleet: %s", card.id, exc)

    async def send(self, runner_id: str, command: RunnerCommand) -> bool:
        """Write a command; False when the runner is gone (its RunnerExited is then on its
        way, or already handled) - logged here, and never silent to the caller."""
        process = self.processes.get(runner_id)
        if process is None:
            log.warning("runner %s is gone: %s not sent", runner_id, command.type)
            return False
        try:
            await process.send(command)
        except (RunnerNotRunning, ConnectionError) as exc:
            log.warning("runner %s: %s not sent: %s", runner_id, command.type, exc)
            return False
        return True

    def stop(self, runner_id: str, kill: bool = False) -> None:
        """Ask the runner to shut down (killed after 10 s), or `kill` it at once; either way
        a deliberate stop, not a crash."""
        if (process := self.processes.get(runner_id)) and runner_id not in self.stopping:
            self.stopping.add(runner_id)
            ending = process.kill() if kill else process.stop(timeout=10.0)
            self.owner.spawn(f"stop runner {runner_id}", ending)

    def abandon(self, runner_id: str) -> None:
        """A runner that refused a task (its pipe is closed) is dying or dead: make sure it is
        dead, so its RunnerExited comes and the tasks in flight there end runner_crashed."""
        if (process := self.processes.get(runner_id)) is not None:
            process.kill_now()

    def exited(self, exited: RunnerExited) -> bool:
        """Forget a runner; True when it crashed (it was not asked to stop)."""
        self.processes.pop(exited.runner_id, None)
        asked = exited.runner_id in self.stopping
        self.stopping.discard(exited.runner_id)
        return not asked and exited.returncode != 0

    async def stop_all(self, timeout: float) -> None:
        standby, self.standby = self.standby, None
        self._standby_broken = True  # none is started after this
        if standby is not None:
            await standby.discard()
        await asyncio.gather(
            *(p.stop(timeout=timeout) for p in self.processes.values()), return_exceptions=True
        )
