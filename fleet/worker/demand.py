"""Placement on demand: a task queued for a model that no instance serves places one.

Two triggers. The janitor's triage sees each task as it is published (one worker of the fleet
per task), and a sweep of FLEET_TASKS' per-subject counts finds tasks queued before any worker
could see them (a fleet that starts after its clients). The instance id is `<model>-auto`,
written with a create-only compare-and-set, so however many workers see the same demand at
once, one instance is placed; removing it by hand lets the next demand place it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.bus.records import InstanceRecords
from fleet.bus.task_queue import TaskQueue
from fleet.errors import PlacementError
from fleet.placement_rules import demand_instance, in_groups
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo

log = logging.getLogger(__name__)

SWEEP_S = 5.0


class Demand:
    def __init__(
        self,
        js: JetStreamContext,
        instances: KeyValue,
        cards: dict[str, ModelCard],
        placed: Callable[[], Iterable[Instance]],
        live_nodes: Callable[[], Iterable[NodeInfo]],
        slots: int,
        nodes_known: asyncio.Event | None = None,
    ) -> None:
        self.js = js
        self.instances = InstanceRecords(instances)
        self.cards = cards
        self.placed = placed
        self.live_nodes = live_nodes
        self.slots = slots
        self.nodes_known = nodes_known or asyncio.Event()
        if nodes_known is None:
            self.nodes_known.set()
        self._unplaceable: set[str] = set()  # warned about once, until a node can take it

    def served(self, model: str) -> bool:
        return any(instance.model == model for instance in self.placed())

    async def want(self, model: str) -> Instance | None:
        """Place `model` if tasks wait for it and nothing serves it; the instance, or None."""
        card = self.cards.get(model)
        if card is None or self.served(model) or not self.nodes_known.is_set():
            return None
        able = [node for node in self.live_nodes() if model in node.models_available]
        try:
            instance = demand_instance(able, card, self.slots, in_groups(self.placed()),
                                       time.time())
        except PlacementError as exc:
            if model not in self._unplaceable:
                log.warning("tasks wait for %s, which no live node can provide: %s", model, exc)
                self._unplaceable.add(model)
            return None
        self._unplaceable.discard(model)
        if not await self.instances.create(instance):
            return None  # another worker answered the same demand first
        log.info("tasks wait for %s: placed %s on %s", model, instance.instance_id,
                 ",".join(s.node_id for s in instance.shards))
        return instance

    async def queued_models(self) -> list[str]:
        counts = await TaskQueue.of(self.js).counts()
        return sorted({subjects.model_of_task_subject(s) for s, count in counts.items() if count})

    async def sweep_forever(self) -> None:
        await self.nodes_known.wait()  # until then every node would look absent
        while True:
            try:
                for model in await self.queued_models():
                    await self.want(model)
            except Exception as exc:
                log.warning("demand sweep failed: %s", exc)
            await asyncio.sleep(SWEEP_S)  # the sweep's period, not synchronisation
