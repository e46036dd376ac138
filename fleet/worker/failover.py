"""Moving instances off dead nodes, on evidence only (fleet.worker.liveness decides).

A sweep runs on start, every SWEEP_S, and at once when a heartbeat key disappears. It reads
fresh snapshots of FLEET_NODES and FLEET_INSTANCES (never the watcher's table alone, which a
reconnect can leave stale), so a placement stranded on a node that died while no worker ran
is healed by whichever worker runs next, by the same rule as a departure seen live.

One worker sweeps for the whole fleet, the holder of the sweeper lease (fleet.worker.sweeper);
should two sweep the same instance for a moment (a lease changing hands), the write is a
compare-and-set on the instance's revision, so exactly one wins.

The one that wins also deletes the prefix adverts of the dead node's runners of that model
(the runners its last heartbeat named): adverts are written never to expire by age
(fleet.worker.prefix_adverts), and readers ignore them as soon as the instance moved
(fleet.worker.routes.advert_live), so this only keeps the bucket from keeping them for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.kv_calls import kv_delete, kv_update
from fleet.bus.kv_read import live_entries, live_values
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo
from fleet.wire.codec import DecodeError, decode_model, encode
from fleet.worker.liveness import Move, Placed, Stranded, plan_moves, seen_dead
from fleet.worker.prefix_adverts import LOAD_SUFFIX, advert_key

log = logging.getLogger(__name__)

SWEEP_S = 5.0


class Failover:
    def __init__(
        self,
        js: JetStreamContext,
        nodes: KeyValue,
        instances: KeyValue,
        cards: dict[str, ModelCard],
        *,
        self_id: str = "",
        trusted: Callable[[], bool] = lambda: True,
        on_own_key_gone: Callable[[], None] = lambda: None,
        on_gap: Callable[[], None] = lambda: None,
    ) -> None:
        self.js = js
        self.nodes = nodes
        self.instances = instances
        self.cards = cards
        self.self_id = self_id
        self.trusted = trusted  # whether an absent key is evidence right now
        self.on_own_key_gone = on_own_key_gone
        self.on_gap = on_gap
        self.live: dict[str, NodeInfo] = {}
        self.loaded = asyncio.Event()  # set once the node table's first reading is in `live`
        # Set at every change of `live` or `declared`: the capability records follow them
        # (fleet.worker.capabilities).
        self.changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._stranded: set[str] = set()  # logged once each, until it moves or heals
        # Nodes the death watch saw die (wall time): gone before their heartbeat key expires.
        self.declared: dict[str, float] = {}
        # Nodes running a rank of a sharded instance, as the last sweep read them: the death
        # watch probes them even when they hold no task message (a rank > 0 never does).
        self.ranked: set[str] = set()
        # Each node's runners as its last heartbeat named them, kept after its key went:
        # whose adverts to delete when its instances move.
        self.runners_seen: dict[str, tuple[str, ...]] = {}

    async def watch(self) -> None:
        """Follow FLEET_NODES for `live` (demand placement reads it) and to sweep at once
        when a key disappears. A (re)start of this watch is a gap in what we saw."""
        self.on_gap()
        watcher = await self.nodes.watchall()
        try:
            async for entry in watcher:
                if entry is None:
                    # nats-py can send its "initial values done" marker before values it has
                    # already received (see bus/kv_read.py): a snapshot fills in what is late.
                    await self.refresh()
                    self.loaded.set()
                    self.changed.set()
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    self._gone(entry.key)
                    continue
                try:
                    info = decode_model(NodeInfo, entry.value)
                except DecodeError:
                    continue
                self.live[entry.key] = info
                self.runners_seen[entry.key] = tuple(info.runners)
                self.changed.set()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.stop(), 2.0)

    def _gone(self, node: str) -> None:
        if node == self.self_id:
            # Our own key expired: we could not write it for a TTL. We are not dead; the
            # heartbeat writes it again now. Never a reason to move our own instances.
            log.warning("own heartbeat key %s expired (the KV was unreachable?); re-registering",
                        node)
            self.on_own_key_gone()
            return
        if self.live.pop(node, None) is not None:
            log.info("heartbeat of node %s is gone; checking whether it left", node)
            self._wake.set()
            self.changed.set()

    def declare_dead(self, node: str) -> None:
        """The death watch saw `node`'s connection gone: sweep now, as if its key expired."""
        self.declared[node] = time.time()
        self._wake.set()
        self.changed.set()

    def forget(self) -> None:
        """No longer watching (the lease went elsewhere): what `live` says is stale."""
        self.live = {}
        self.loaded.clear()
        self.declared = {}

    async def refresh(self) -> list[NodeInfo]:
        nodes = await live_values(self.js, subjects.NODES_BUCKET, NodeInfo)
        self.live = {node.node_id: node for node in nodes}
        self.runners_seen.update((node.node_id, tuple(node.runners)) for node in nodes)
        return nodes

    async def sweep_forever(self) -> None:
        """Sweep on start and every SWEEP_S, or sooner when a heartbeat disappears."""
        while True:
            self._wake.clear()
            try:
                await self.sweep()
            except Exception as exc:  # the next period tries again; a broker outage is logged
                log.warning("failover sweep failed: %s", exc)
            await set_within(self._wake, SWEEP_S)  # the period, not synchronisation

    async def sweep(self) -> list[Move | Stranded]:
        """Move every instance whose nodes are dead to a live node that can serve it."""
        trusted = self.trusted()  # before the reads: evidence is what was true all along
        if not trusted and not self.declared:
            return []
        nodes = seen_dead(await self.refresh(), self.declared)
        # Seen dead by the death watch and not beating since: gone, even while this
        # worker's KV view is not trusted yet (a sweeper that just took the lease over).
        beating = {node.node_id for node in nodes}
        seen_gone = {node for node in self.declared if node not in beating}
        placed = []
        for entry in await live_entries(self.js, subjects.INSTANCES_BUCKET):
            try:
                placed.append(Placed(decode_model(Instance, entry.value), entry.revision))
            except DecodeError:
                continue
        self.ranked = {shard.node_id for p in placed if p.instance.sharded
                       for shard in p.instance.shards}
        # Re-checked after the reads: a gap while reading makes the snapshot suspect.
        decisions = plan_moves(placed, nodes, self.self_id, trusted and self.trusted(),
                               self.cards, time.time(), seen_gone)
        for decision in decisions:
            if isinstance(decision, Stranded):
                if decision.instance_id not in self._stranded:
                    self._stranded.add(decision.instance_id)
                    log.warning("%s is on dead node(s) %s and no live node can serve it (%s); "
                                "it waits", decision.instance_id, ",".join(decision.gone),
                                decision.why)
                continue
            self._stranded.discard(decision.instance_id)
            await self._move(decision)
        return decisions

    async def _move(self, move: Move) -> None:
        written = await kv_update(
            self.instances, move.instance_id, encode(move.instance), last=move.revision
        )
        if written is None:
            log.info("%s was re-placed by another worker", move.instance_id)
        else:
            log.warning("node(s) %s left: moved %s to %s", ",".join(move.gone),
                        move.instance_id, move.target)
            await self._forget_adverts(move)

    async def _forget_adverts(self, move: Move) -> None:
        """The moved instance's model's adverts of the runners its dead nodes last named."""
        keys = [advert_key(move.instance.model, runner) + suffix for node in move.gone
                for runner in self.runners_seen.get(node, ()) for suffix in ("", LOAD_SUFFIX)]
        if not keys:
            return
        try:
            prefixes = await self.js.key_value(subjects.PREFIXES_BUCKET)
            for key in keys:
                await kv_delete(prefixes, key)
        except Exception as exc:  # readers ignore them already; the next move tries no more
            log.info("adverts of %s not deleted: %s", ",".join(move.gone), exc)
