"""What gateways read of the nodes, kept once for the fleet by the sweeper (issue 22).

A gateway's answers (its 503s, /v1/models' `available`, fleet.gateway.catalogue) read of the
nodes only which models some live node can provide and the room placement weighs (free memory,
disk room, a ring address). Heartbeats carry those and much that changes at every beat (the
time, the held acks, the runners); a gateway that watched FLEET_NODES heard N/3 beats a second.
Instead the sweeper, which watches every heartbeat and decides node death already
(fleet.worker.failover), writes a compact record per live node to FLEET_CAPABILITIES when those
facts change, and deletes it when the node is gone; a gateway watches that bucket.

- Free memory moves a little at every beat: a record is rewritten when it moves by more than
  MEMORY_STEP of the node's memory, so a gateway's view is within that of the heartbeat's.
- A record is deleted when the node's heartbeat key is gone while absences are evidence
  (`trusted`, the failover's rule), or at once when the death watch declared it dead.
- The sweeper also rewrites the `keeper` key every KEEPER_S: with no worker left nobody deletes
  the last records, and a gateway reads each record as fresh as the keeper's mark: silent
  once that is older than HEARTBEAT_STALE_S, as a heartbeat that old was before.
- A new sweeper (the lease taken over) reads the bucket and the heartbeats afresh, so what
  the old one left undone (it died midway) is done on takeover: records of nodes that died
  meanwhile go, new nodes' are written.
Two sweepers for a moment write the same records from the same heartbeats; nothing rests on
who writes. The decisions are pure, in fleet.capability_rules (table-tested).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.kv_calls import kv_delete, kv_put, open_bucket
from fleet.bus.kv_read import live_entries
from fleet.capability_rules import KEEPER_S, Changes, capabilities_of, plan_changes
from fleet.wire import subjects
from fleet.wire.cluster import CapabilitiesKeeper, NodeCapabilities, NodeInfo
from fleet.wire.codec import DecodeError, decode_model, encode
from fleet.worker.failover import Failover
from fleet.worker.liveness import seen_dead

log = logging.getLogger(__name__)

ROUND_S = 0.25  # heartbeats arriving within this are folded into one round of writes


def alive(live: Mapping[str, NodeInfo], declared: dict[str, float]) -> dict[str, NodeInfo]:
    """The heartbeats of `live` less the nodes the death watch declared dead since. Pure."""
    return {info.node_id: info for info in seen_dead(live.values(), declared)}


class CapabilityRecords:
    """The sweeper's duty: FLEET_CAPABILITIES follows the heartbeats `failover` watches."""

    def __init__(self, js: JetStreamContext, failover: Failover, node_id: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.js, self.failover, self.node_id, self.clock = js, failover, node_id, clock
        self.written: dict[str, NodeCapabilities] | None = None  # None: read the bucket
        self._seen: dict[str, tuple[NodeInfo, NodeCapabilities]] = {}  # by heartbeat object
        self.writes = 0  # puts and deletes made (for tests and the bench)

    async def forever(self) -> None:
        """Until cancelled (a duty of the sweeper's): a round at each change of the
        heartbeats (at most every ROUND_S) and every KEEPER_S."""
        try:
            kv = await open_bucket(self.js, subjects.CAPABILITIES_BUCKET)
        except BucketNotFoundError:
            # A fleet provisioned before the bucket: failover must not stop for it (a duty
            # that fails stops them all). Gateways then know no node until provisioning.
            log.warning("bucket %s is not provisioned: gateways will not learn the nodes' "
                        "models (run `fleet nats --provision`)", subjects.CAPABILITIES_BUCKET)
            await asyncio.Event().wait()  # until cancelled with the other duties
        await self.failover.loaded.wait()  # before it, every node would look gone
        kept_at = -KEEPER_S
        while True:
            self.failover.changed.clear()
            try:
                await self.round(kv)
                if (now := time.monotonic()) - kept_at >= KEEPER_S:
                    await kv_put(kv, subjects.CAPABILITIES_KEEPER, encode(
                        CapabilitiesKeeper(node_id=self.node_id, at=self.clock())))
                    kept_at = now
            except Exception as exc:  # a broker outage: read the bucket afresh next round
                log.warning("capability records not kept this round: %s", exc)
                self.written = None
            await set_within(self.failover.changed, KEEPER_S)  # a change, or the period
            await asyncio.sleep(ROUND_S)  # gathering the next beats, not synchronisation

    async def round(self, kv: KeyValue) -> Changes:
        if self.written is None:
            self.written = await self._read()
        declared = dict(self.failover.declared)
        changes = plan_changes(self._current(alive(self.failover.live, declared)),
                               self.written, trusted=self.failover.trusted(), declared=declared)
        for node, record in changes.puts.items():
            await kv_put(kv, subjects.capabilities_key(node), encode(record))
            self.written[node] = record
        for node in changes.deletes:
            await kv_delete(kv, subjects.capabilities_key(node))
            self.written.pop(node, None)
            log.info("node %s is gone: its capabilities are withdrawn from the gateways", node)
        self.writes += len(changes.puts) + len(changes.deletes)
        return changes

    def _current(self, nodes: dict[str, NodeInfo]) -> dict[str, NodeCapabilities]:
        """Each live node's record, made again only for a heartbeat not seen before."""
        current = {}
        for node, info in nodes.items():
            seen = self._seen.get(node)
            if seen is None or seen[0] is not info:
                seen = self._seen[node] = (info, capabilities_of(info))
            current[node] = seen[1]
        for node in self._seen.keys() - nodes.keys():
            del self._seen[node]
        return current

    async def _read(self) -> dict[str, NodeCapabilities]:
        """The bucket's records as they are (a takeover reconciles from them)."""
        records = {}
        for entry in await live_entries(self.js, subjects.CAPABILITIES_BUCKET):
            if (node := subjects.node_of_capabilities_key(entry.key)) is None:
                continue
            try:
                records[node] = decode_model(NodeCapabilities, entry.value)
            except DecodeError:  # rewritten from the node's heartbeat, or deleted
                records[node] = NodeCapabilities.model_construct(node_id=node)
        return records
