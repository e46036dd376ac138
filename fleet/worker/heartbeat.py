"""This node's heartbeat in FLEET_NODES, and the record of its own KV round trips that
liveness decisions weigh (fleet.worker.liveness): a worker that could not write its own key
lately judges no other node dead.

The heartbeat also lists the ack subjects of the task messages this node holds
(`NodeInfo.held_acks`), beaten again within HELD_CHECK_S of a new one, and the worker answers
probes on `fleet.alive.<node>` while its process lives: together they let the sweeper see
this node die within a second or two and hand its tasks on (fleet.worker.deathwatch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.kv_calls import bucket_max_age
from fleet.bus.records import NodeRecords, RunnerRecords
from fleet.bus.replies import inbox_reply
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo, RunnerRecord
from fleet.worker.liveness import (
    LinkHealth,
    beat_failed,
    beat_succeeded,
    gap_seen,
    trusts_absences,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 3.0
# A task message held since the last beat is listed within HELD_CHECK_S (a death in that
# window leaves it to AckWait); a burst of new ones is listed at most every HELD_GAP_S.
HELD_CHECK_S = 0.05
HELD_GAP_S = 0.25
NODE_TTL_S = 15.0  # FLEET_NODES' max age in ops/jetstream; read from the bucket at start


class Heartbeat:
    def __init__(
        self, nc: Client, nodes: KeyValue, runners: KeyValue, node_id: str,
        info: Callable[[], NodeInfo], records: Callable[[], list[RunnerRecord]],
    ) -> None:
        self.nc = nc
        self.nodes = nodes
        self.runners = runners
        self.node_records, self.runner_records = NodeRecords(nodes), RunnerRecords(runners)
        self.node_id = node_id
        self.info = info
        self.records = records  # re-put each round, so their keys outlive their TTL
        self.health = LinkHealth()
        self.ttl_s = NODE_TTL_S
        self.wake = asyncio.Event()  # set to beat now (our own key was seen to expire)
        self._reconnects = 0
        # The ack subjects of the task messages this node holds (set by the worker).
        self.held: Callable[[], list[str]] = list
        self._listed: frozenset[str] = frozenset()  # what the last beat listed

    async def read_ttl(self, js: JetStreamContext) -> None:
        """How long a silent node's key lives: the bucket's max age (the TTL of record)."""
        try:
            max_age = await bucket_max_age(js, subjects.NODES_BUCKET)
        except Exception as exc:
            log.warning("node bucket TTL unknown (%s); assuming %.0f s", exc, NODE_TTL_S)
            return
        self.ttl_s = max_age or NODE_TTL_S

    def trusts_absences(self) -> bool:
        """Whether an absent heartbeat key is evidence of a dead node, now."""
        return trusts_absences(self.health, time.monotonic(), self.ttl_s, HEARTBEAT_S)

    def gap(self) -> None:
        """A reconnect or a restarted watch: what we saw before may have holes."""
        self.health = gap_seen(self.health)

    async def beat(self, budget_s: float = HEARTBEAT_S, *, records: bool = True) -> None:
        """One round; its outcome is the evidence `trusts_absences` weighs. `records`: the
        runner records are re-put too (every HEARTBEAT_S)."""
        reconnects = self.nc.stats.get("reconnects", 0)
        if reconnects != self._reconnects:
            # Reconnected since the last round, however briefly: what we watched has holes.
            self._reconnects = reconnects
            self.gap()
        try:
            if not self.nc.is_connected:
                raise ConnectionError("not connected to NATS")
            held = self.held()
            info = self.info().model_copy(update={"held_acks": held})
            await self.node_records.put(info, budget_s=budget_s)
            self._listed = frozenset(held)
        except Exception as exc:
            if self.health.failures == 0:
                log.warning("heartbeat failed (%s); no node is judged dead until it is back "
                            "for %.0f s", exc, self.ttl_s)
            self.health = beat_failed(self.health)
            return
        if self.health.failures:
            log.info("heartbeat back after %d failed round(s)", self.health.failures)
        self.health = beat_succeeded(self.health, time.monotonic())
        for record in self.records() if records else ():
            try:
                await self.runner_records.put(record, budget_s=budget_s)
            except Exception as exc:
                log.warning("runner record %s not refreshed: %s", record.runner_id, exc)

    async def forever(self) -> None:
        """Beat every HEARTBEAT_S, at once when our own key was seen to expire, and within
        HELD_CHECK_S of a newly held task message; answer probes meanwhile."""
        alive = await self.nc.subscribe(subjects.alive(self.node_id), cb=self._answer)
        last = last_full = time.monotonic()
        try:
            while True:
                await set_within(self.wake, HELD_CHECK_S)
                now = time.monotonic()
                full = self.wake.is_set() or now - last_full >= HEARTBEAT_S
                if full or (now - last >= HELD_GAP_S
                            and newly_held(self.held(), self._listed)):
                    self.wake.clear()
                    last = now
                    last_full = now if full else last_full
                    await self.beat(records=full)  # a new hold: the node's key alone
        finally:
            with contextlib.suppress(Exception):
                await alive.unsubscribe()

    async def _answer(self, msg: Msg) -> None:
        """A probe: any answer says this process lives (only on an inbox: a capability)."""
        if (reply := inbox_reply(msg.reply)) is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(reply, b"")


def newly_held(held: list[str], listed: frozenset[str]) -> bool:
    """Pure. Whether a message is held that the last beat did not list (one that ended since
    is harmless there: a nak of a settled message does nothing)."""
    return any(subject not in listed for subject in held)
