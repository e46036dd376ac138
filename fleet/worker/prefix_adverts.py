"""Advertising what each runner's prefix cache holds: FLEET_PREFIXES, a key per runner
under its model (`<model>.<runner id>`), and reading the adverts of the models this node serves.

The worker's own dispatch reads its state directly; the bucket is what the rest of the fleet
sees (operators, and other workers, which hand tasks over to a runner here when it holds more
of the prompt: fleet.worker.handoff). A runner's summary is written when its blocks or its
load changed, at most once per `every_s` (a quarter second: other workers weigh its load by
it), and only then: it is written never to expire by age (fleet.bus.kv_lasting), so an idle
runner costs its readers nothing. Readers judge whether a runner is alive by the instance
table, not by the advert's age (fleet.worker.routes.advert_live); a runner that left is
deleted by its worker. On a bucket that does not allow per-message TTLs (provisioned before),
a summary is refreshed every REFRESH_S as before, so the bucket's TTL keeps only live ones.
Compact: its blocks (up to ~70 KB for 4,096) go in a whole summary at most once a second,
and a change of load alone goes as a load update of a few hundred bytes under
`<model>.<runner id>.load`, merged with the whole one by the reader.

Who hears an advert: only a worker that serves the same model. A task is only ever handed
over between runners of its model, so a worker watches `<model>.>` for each model placed on
it (`ServedPrefixes`), and a summary of up to ~70 KB rewritten four times a second reaches the
few nodes that could use it, not the whole fleet; idle, nothing at all: a node's cost does
not grow with the number of nodes serving any model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.aio import started
from fleet.bus.kv_calls import kv_delete, kv_put
from fleet.bus.kv_lasting import put_lasting
from fleet.bus.kv_mirror import Connection, Mirror
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.prefixes import PrefixSummary
from fleet.worker.prefix_blocks import BLOCK_CHARS
from fleet.worker.routes import has_spare_core
from fleet.worker.state import RunnerView, WorkerState

log = logging.getLogger(__name__)

REFRESH_S = 20.0  # the bucket's TTL is 60 s: only where adverts cannot be written to last
BLOCKS_EVERY_S = 1.0  # a whole summary (its blocks) at most this often; load updates 4/s
MODELS_CHECK_S = 1.0  # how often the set of served models is compared with the watches
LOAD_SUFFIX = ".load"


@dataclass(frozen=True)
class Written:
    """What was last advertised of a runner: its blocks (by hash) and load, and when."""

    blocks: int
    load: tuple[int, int, bool]  # tasks, prefill blocks, has a spare core
    whole_at: float  # its last whole summary
    load_at: float  # its last load update (or whole summary)


def advert_due(last: Written | None, blocks: int, load: tuple[int, int, bool],
               now: float, refresh_s: float | None = None) -> str | None:
    """Pure: what to write for a runner now: "whole" (blocks changed, at most once per
    BLOCKS_EVERY_S, or a refresh every `refresh_s` where adverts expire by age), "load"
    (only its load changed), or None."""
    if last is None or (refresh_s is not None and now - last.whole_at >= refresh_s):
        return "whole"
    if blocks != last.blocks and now - last.whole_at >= BLOCKS_EVERY_S:
        return "whole"
    if load != last.load:
        return "load"
    return None


def merged(whole: bytes | None, load: bytes | None) -> bytes | None:
    """Pure: a runner's whole summary with the load of its newer load update, if any."""
    if whole is None or load is None:
        return whole
    base, update = orjson.loads(whole), orjson.loads(load)
    if update.get("at", 0) <= base.get("at", 0):
        return whole
    for name in ("in_flight", "slots", "prefilling", "prefill_blocks", "spare_cores", "at"):
        if name in update:
            base[name] = update[name]
    return orjson.dumps(base)


def advert_key(model: str, runner_id: str) -> str:
    """A runner's key: under its model, so a watch of `<model>.>` sees only that model's."""
    return f"{model}.{runner_id}"


def model_filter(model: str) -> str:
    return f"{model}.>"


def watches_to_change(serving: set[str], watched: set[str]) -> tuple[set[str], set[str]]:
    """Pure: the models whose adverts to start watching, and those to stop watching."""
    return serving - watched, watched - serving


def summary(runner: RunnerView, node_id: str, now: float,
            spare_cores: float | None = None, load_only: bool = False) -> PrefixSummary:
    return PrefixSummary(
        runner_id=runner.runner_id, node_id=node_id, model=runner.model, load_only=load_only,
        block_chars=BLOCK_CHARS,
        blocks=[] if load_only else [f"{b:016x}" for b in runner.held.order],
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
        self._written: dict[str, Written] = {}
        self._keys: dict[str, str] = {}  # runner -> its key (under its model)
        self._kv: KeyValue | None = None
        self.lasting = True  # adverts written never to expire; False: refreshed instead

    async def _put(self, kv: KeyValue, key: str, value: bytes) -> None:
        if self.lasting and await put_lasting(self.js, kv, key, value):
            return
        if self.lasting:
            log.warning("FLEET_PREFIXES does not allow per-message TTLs (provisioned before "
                        "they were used): adverts are refreshed every %.0f s instead; run "
                        "`fleet nats --provision` as the operator", REFRESH_S)
            self.lasting = False
        await kv_put(kv, key, value)

    async def forever(self) -> None:
        self._kv = self._kv or await self.js.key_value(subjects.PREFIXES_BUCKET)
        while True:
            await self.write_changes(self._kv)
            await asyncio.sleep(self.every_s)  # pacing: a summary per runner per period

    async def write_changes(self, kv: KeyValue) -> None:
        state, now = self.state(), time.time()
        # A rank > 0 of a sharded instance takes no tasks: nothing to advertise.
        for runner in (r for r in state.runners.values() if r.rank == 0):
            # what other nodes' routing reads
            blocks = hash(runner.held.order)
            load = (len(runner.in_flight), runner.prefill_blocks,
                    has_spare_core(state.spare_cores))
            last = self._written.get(runner.runner_id)
            due = advert_due(last, blocks, load, now, None if self.lasting else REFRESH_S)
            if due is None:
                continue
            key = advert_key(runner.model, runner.runner_id)
            self._keys[runner.runner_id] = key
            if due == "whole":
                await self._put(kv, key, encode(summary(runner, state.node_id, now,
                                                        state.spare_cores)))
                self._written[runner.runner_id] = Written(blocks, load, now, now)
            else:
                assert last is not None
                await self._put(kv, key + LOAD_SUFFIX, encode(summary(
                    runner, state.node_id, now, state.spare_cores, load_only=True)))
                self._written[runner.runner_id] = Written(last.blocks, load, last.whole_at, now)
        for gone in set(self._written) - {r for r, v in state.runners.items() if v.rank == 0}:
            key = self._keys.pop(gone)
            await kv_delete(kv, key)
            await kv_delete(kv, key + LOAD_SUFFIX)
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
        """A runner's whole summary and its load update, merged into one value under the
        runner's key: what RemoteRunners parses."""
        raw = {k: v for mirror, _ in self._mirrors.values() for k, v in mirror.values.items()}
        runners = ({k.removesuffix(LOAD_SUFFIX) for k in raw} if key is None
                   else {key.removesuffix(LOAD_SUFFIX)})
        if key is None:
            self.values = {}
        for runner in runners:
            value = merged(raw.get(runner), raw.get(runner + LOAD_SUFFIX))
            if value is None:
                self.values.pop(runner, None)
            else:
                self.values[runner] = value
        self.on_change(self.values, None if key is None else key.removesuffix(LOAD_SUFFIX))

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
                    running = started(mirror.run(link), f"prefix mirror {model}")
                    self._mirrors[model] = (mirror, running)
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
