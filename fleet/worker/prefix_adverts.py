"""Advertising what each runner's prefix cache holds: FLEET_PREFIXES, a key per runner.

The worker's own dispatch reads its state directly; the bucket is what the rest of the fleet
sees (operators, dashboards, and other workers, which hand tasks over to a runner here when
it holds more of the prompt: fleet.worker.handoff). A runner's summary is written when its
blocks or its load changed, at most once per `every_s` (a quarter second: other workers weigh
its load by it), and at least once per REFRESH_S so the bucket's TTL keeps only runners whose
worker is alive; a runner that left is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.bus.kv_calls import kv_delete, kv_put
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.prefixes import PrefixSummary
from fleet.worker.prefix_blocks import BLOCK_CHARS
from fleet.worker.routes import has_spare_core
from fleet.worker.state import RunnerView, WorkerState

log = logging.getLogger(__name__)

REFRESH_S = 20.0  # the bucket's TTL is 60 s


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
            await kv_put(kv, runner.runner_id,
                         encode(summary(runner, state.node_id, now, state.spare_cores)))
            self._written[runner.runner_id] = (*mark, now)
        for gone in set(self._written) - {r for r, v in state.runners.items() if v.rank == 0}:
            await kv_delete(kv, gone)
            del self._written[gone]
