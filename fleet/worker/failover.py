"""When a node leaves (its FLEET_NODES key expires), its instances move to a live node.

Every worker sees the same departure and races to re-place; the write is a compare-and-set
on the instance's revision, so exactly one wins and the others learn it from the next watch.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.bus.kv_read import live_entries, live_values
from fleet.errors import FleetError
from fleet.placement import choose_node, moved
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo
from fleet.wire.codec import DecodeError, decode_model, encode

log = logging.getLogger(__name__)


class Failover:
    def __init__(
        self, js: JetStreamContext, nodes: KeyValue, instances: KeyValue,
        cards: dict[str, ModelCard],
    ) -> None:
        self.js = js
        self.nodes = nodes
        self.instances = instances
        self.cards = cards
        self.live: dict[str, NodeInfo] = {}
        self.loaded = asyncio.Event()  # set once the node table's first reading is in `live`

    async def watch(self) -> None:
        watcher = await self.nodes.watchall()
        async for entry in watcher:
            if entry is None:
                # nats-py can send its "initial values done" marker before values it has
                # already received (see bus/kv_read.py): a snapshot fills in what is late.
                for info in await live_values(self.js, subjects.NODES_BUCKET, NodeInfo):
                    self.live.setdefault(info.node_id, info)
                self.loaded.set()
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                if self.live.pop(entry.key, None) is not None:
                    log.warning("node %s left; re-placing its instances", entry.key)
                    await self.replace_from(entry.key)
                continue
            try:
                self.live[entry.key] = decode_model(NodeInfo, entry.value)
            except DecodeError:
                continue

    async def replace_from(self, gone: str) -> None:
        for entry in await live_entries(self.js, subjects.INSTANCES_BUCKET):
            key = entry.key
            try:
                instance = decode_model(Instance, entry.value or b"")
            except DecodeError:
                continue
            if all(shard.node_id != gone for shard in instance.shards):
                continue
            card = self.cards.get(instance.model) or _unknown_card(instance.model)
            candidates = [
                n for n in self.live.values()
                if n.node_id != gone and instance.model in n.models_available
            ]
            try:
                target = choose_node(candidates, card, time.time())
            except FleetError:
                log.warning("no live node for %s; it waits for %s to return", key, gone)
                continue
            try:
                await self.instances.update(
                    key, encode(moved(instance, gone, target.node_id)), last=entry.revision
                )
                log.info("moved %s from %s to %s", key, gone, target.node_id)
            except KeyWrongLastSequenceError:
                log.info("%s was re-placed by another worker", key)


def _unknown_card(model: str) -> ModelCard:
    return ModelCard(id=model, name=model, tasks=["text_generation"], family="unknown",
                     source="unknown")

