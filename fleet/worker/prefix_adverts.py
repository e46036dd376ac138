"""Advertising what each runner's prefix cache holds: FLEET_PREFIXES, a key per runner
under its model (`<model>.<runner id>`), and reading the adverts of the models this node serves.

The worker's own dispatch reads its state directly; the bucket is what the rest of the fleet
sees (operators, and other workers, which hand tasks over to a runner here when it holds more
of the prompt: fleet.worker.handoff). A runner's summary is written when its blocks or its
load changed, at most once per `every_s` (a quarter second: other workers weigh its load by
it), and at least once per REFRESH_S so the bucket's TTL keeps only runners whose worker is
alive; a runner that left is deleted.

Who hears an advert: only a worker that serves the same model. A task is only ever handed
over between runners of its model, so a worker watches `<model>.>` for each model placed on
it (`ServedPrefixes`), and a summary of up to ~70 KB rewritten four times a second reaches the
few nodes that could use it, not the whole fleet: a node's cost no longer grows with the
number of nodes serving other models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.bus.kv_calls import kv_delete, kv_put
from fleet.bus.kv_mirror import Connection, Mirror
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.prefixes import PrefixSummary
from fleet.worker.prefix_blocks import BLOCK_CHARS
from fleet.worker.routes import has_spare_core
from fleet.worker.state import RunnerView, WorkerState

log = logging.getLogger(__name__)

REFRESH_S = 20.0  # the bucket's TTL is 60 s
MODELS_CHECK_S = 1.0  # how often the set of served models is compared with the watches


def advert_key(model: str, runner_id: str) -> str:
    """A runner's key: under its model, so a watch of `<model>.>` sees only that model's."""
    return f"{model}.{runner_id}"


def model_filter(model: str) -> str:
    return f"{model}.>"


def watches_to_change(serving: set[str], watched: set[str]) -> tuple[set[str], set[str]]:
    """Pure: the models whose adverts to start watching, and those to stop watching."""
    return serving - watched, watched - serving


def summary(runner: RunnerView, node_id: str, now: float,
            spare_cores: float | None = None) -> PrefixSummary:
    return PrefixSummary(
        runner_id=runner.runner_id, node_id=node_id, model=runner.model,
        block_chars=BLOCK_CHARS, blocks=[f"{b:016x}" for b in runner.held.order],
        # A rank > 0 of a sharded instance takes no tasks: no slots for other nodes to see.
        in_flight=len(runner.in_flight), slots=runner.slots if runner.rank == 0 else 0,
        prefilling=len(runner.prefill),
        prefill_blocks=runner.prefill_blocks, spare_cores=spare_cores, at=now,
    )


class PrefixAdverts:
    def __init__(self, js: JetStreamContext, state: Callable[[], WorkerState],
                 every_s: float = 0.25) -> None:
        self.js = js
        self.state = state
        self.every_s = every_s
        # runner -> (blocks id, tasks, prefill blocks, has a spare core, at)
        self._written: dict[str, tuple[int, int, int, bool, float]] = {}
        self._keys: dict[str, str] = {}  # runner -> its key (under its model)
        self._kv: KeyValue | None = None

    async def forever(self) -> None:
        self._kv = self._kv or await self.js.key_value(subjects.PREFIXES_BUCKET)
        while True:
            await self.write_changes(self._kv)
            await asyncio.sleep(self.every_s)  # pacing: a summary per runner per period

    async def write_changes(self, kv: KeyValue) -> None:
        state, now = self.state(), time.time()
        # A rank > 0 of a sharded instance takes no tasks: nothing to advertise.
        for runner in (r for r in state.runners.values() if r.rank == 0):
            mark = (hash(runner.held.order), len(runner.in_flight), runner.prefill_blocks,
                    has_spare_core(state.spare_cores))  # what other nodes' routing reads
            last = self._written.get(runner.runner_id)
            if last is not None and last[:4] == mark and now - last[4] < REFRESH_S:
                continue
            key = advert_key(runner.model, runner.runner_id)
            await kv_put(kv, key, encode(summary(runner, state.node_id, now, state.spare_cores)))
            self._written[runner.runner_id] = (*mark, now)
            self._keys[runner.runner_id] = key
        for gone in set(self._written) - {r for r, v in state.runners.items() if v.rank == 0}:
            await kv_delete(kv, self._keys.pop(gone))
            del self._written[gone]


class ServedPrefixes:
    """The adverts of the models this node serves, mirrored: one filtered watch per model
    (fleet.bus.kv_mirror), started and stopped as models are placed here or leave.
    `on_change(values, key)` as a Mirror's, over the union of the watches (`key` None: the
    whole view was replaced)."""

    def __init__(self, models: Callable[[], set[str]],
                 on_change: Callable[[dict[str, bytes], str | None], None]) -> None:
        self.models = models
        self.on_change = on_change
        self.values: dict[str, bytes] = {}
        self._mirrors: dict[str, tuple[Mirror, asyncio.Task[None]]] = {}

    def _changed(self, key: str | None) -> None:
        self.values = {key: value for mirror, _ in self._mirrors.values()
                       for key, value in mirror.values.items()}
        self.on_change(self.values, key)

    async def run(self, link: Connection) -> None:
        """Until cancelled (a Supervisor child)."""
        try:
            while True:
                for model, (_, task) in list(self._mirrors.items()):
                    if task.done():  # a failed watch is logged and started again
                        if not task.cancelled() and (exc := task.exception()) is not None:
                            log.warning("prefix adverts of %s: watch failed: %s", model, exc)
                        del self._mirrors[model]
                start, stop = watches_to_change(self.models(), set(self._mirrors))
                for model in start:
                    mirror = Mirror(subjects.PREFIXES_BUCKET, self._changed,
                                    keys=model_filter(model))
                    self._mirrors[model] = (mirror, asyncio.create_task(mirror.run(link)))
                for model in stop:
                    _, task = self._mirrors.pop(model)
                    await _cancelled(task)
                if stop:
                    self._changed(None)
                await asyncio.sleep(MODELS_CHECK_S)  # the check's period
        finally:
            for _, task in self._mirrors.values():
                await _cancelled(task)
            self._mirrors.clear()


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
