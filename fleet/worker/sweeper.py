"""Fleet-wide duties, done once for the whole fleet: the worker holding the `sweeper` lease in
FLEET_LEASES watches every heartbeat (FLEET_NODES), moves instances off dead nodes
(fleet.worker.failover), keeps what gateways read of the nodes (fleet.worker.capabilities),
places models on demand (fleet.worker.demand) and answers tasks of unknown models
(fleet.worker.janitor's triage). Every other worker watches no heartbeat at all,
so a node's cost does not grow with the number of nodes.

The lease is a key naming its holder, made with a create-only write and renewed every RENEW_S
by a compare-and-set on its revision; the bucket's max age (10 s) drops it when its holder
stops renewing (dead, or cut off), and the next worker to try (each tries every CONTEND_S)
creates it. Safety never rests on
the lease: each move is a compare-and-set on the instance's revision (exactly one writer wins),
and a holder that was cut off and comes back finds its revision stale, so it stops; two
holders for a moment can only race for the same compare-and-set, as every worker did before.
A worker that could not renew stops its duties at once.

Seeing a node die (fleet.worker.deathwatch) is a duty too: the sweeper's holder probes every
busy node. Its own death is watched by the holder of a second lease, the sentinel, which a
worker without the sweeper lease contends for and which probes the sweeper's holder alone.
A worker that takes the sweeper lease while it holds the sentinel's stops its sentinel watch
and gives that lease up at once (another worker takes it within CONTEND_S).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.aio import CLOSE_WAIT_S, Supervisor, cancel_and_wait, set_within, started
from fleet.bus.kv_calls import kv_create, kv_get, kv_update, open_bucket
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import DecodeError, decode_model
from fleet.worker.capabilities import CapabilityRecords
from fleet.worker.deathwatch import DeathWatch
from fleet.worker.demand import Demand
from fleet.worker.failover import Failover
from fleet.worker.janitor import Janitor

log = logging.getLogger(__name__)

LEASES_BUCKET = "FLEET_LEASES"
SWEEPER = "sweeper"
SENTINEL = "sentinel"  # watches the sweeper's holder
RENEW_S = 2.0  # the bucket's max age is 10 s: five renewals may fail before the lease goes
# How often a worker without the lease tries to take it: a create refused by the server is
# an API call, and every worker of the fleet makes one (1,000 nodes: 200 a second).
CONTEND_S = 5.0
RENEW_BUDGET_S = 1.5  # a renewal slower than this could outlive the lease; try again later


@dataclass(frozen=True)
class LeaseState:
    """What this worker knows of its lease: the revision it last wrote (None: not held)."""

    revision: int | None = None

    @property
    def held(self) -> bool:
        return self.revision is not None


def after_attempt(state: LeaseState, written: int | None) -> LeaseState:
    """Pure: the lease after a create (not held) or a renewal (held) that wrote `written`
    (None: someone else's key was there, or ours had expired and been taken)."""
    return LeaseState(written)


class Lease:
    """One named lease in FLEET_LEASES, held by `holder` while `attempt()` keeps succeeding."""

    def __init__(self, kv: KeyValue, name: str, holder: str) -> None:
        self.kv, self.name, self.holder = kv, name, holder
        self.state = LeaseState()

    async def attempt(self) -> bool:
        """Renew the lease if held, else try to take it; whether it is held now."""
        value = self.holder.encode()
        try:
            if self.state.held:
                assert self.state.revision is not None
                written = await kv_update(self.kv, self.name, value, last=self.state.revision,
                                          budget_s=RENEW_BUDGET_S)
            else:
                written = await kv_create(self.kv, self.name, value, budget_s=RENEW_BUDGET_S)
        except Exception as exc:  # unreachable: not held (another may take it after its age)
            if self.state.held:
                log.warning("lease %s not renewed (%s); its duties stop here", self.name, exc)
            self.state = LeaseState()
            return False
        was = self.state.held
        self.state = after_attempt(self.state, written)
        if was and not self.state.held:
            log.warning("lease %s was lost (it expired and another worker holds it)", self.name)
        return self.state.held


class FleetDuties:
    """Runs `duties` while this worker holds the sweeper lease, and stops them when it does
    not."""

    def __init__(self, js: JetStreamContext, node_id: str, failover: Failover,
                 demand: Demand | None = None, janitor: Janitor | None = None,
                 nc: Client | None = None,
                 link_since: Callable[[], float | None] | None = None) -> None:
        self.js = js
        self.nc = nc  # None: no death watch (tests of the other duties)
        self.link_since = link_since  # the heartbeat's: since when our KV trips go through
        self._leases: KeyValue | None = None
        self._freeing: set[asyncio.Task[None]] = set()
        self.node_id = node_id
        self.failover = failover
        # What gateways read of the nodes, kept from the heartbeats this duty watches.
        self.capabilities = CapabilityRecords(js, failover, node_id)
        self.demand = demand
        self.janitor = janitor
        self.leading = asyncio.Event()  # set while the duties run here
        self._duties: asyncio.Task[None] | None = None
        self._sentinel: asyncio.Task[None] | None = None
        # Set when a dead holder's lease was freed: contend now, not at the next period
        # (the sentinel's 2 s period was 2 s of a sharded group's seam, issue 24).
        self._contend_now = asyncio.Event()

    async def forever(self) -> None:
        """Until cancelled (a Supervisor child): take or renew the lease every RENEW_S."""
        kv = await open_bucket(self.js, LEASES_BUCKET)
        self._leases = kv
        lease = Lease(kv, SWEEPER, self.node_id)
        sentinel = Lease(kv, SENTINEL, self.node_id)
        try:
            while True:
                held = await lease.attempt()
                if held and self._duties is None:
                    log.info("this worker now holds the sweeper lease: failover and placement "
                             "on demand run here")
                    self._duties = started(self._run_duties(), "sweeper duties")
                elif not held and self._duties is not None:
                    await self._stop_duties()
                elif self._duties is not None and self._duties.done():
                    self._duties = None  # failed (logged by _run_duties); started next round
                watching = await self._sentinel_round(sentinel, kv, sweeping=held)
                # The lease's periods: renew what is held, contend for the rest.
                await set_within(self._contend_now,  # the period, not synchronisation
                                 RENEW_S if held or watching else CONTEND_S)
                self._contend_now.clear()
        finally:
            await self._stop_duties()
            await _stop(self._sentinel)

    async def _sentinel_round(self, sentinel: Lease, kv: KeyValue, *, sweeping: bool) -> bool:
        """Hold the sentinel lease (and watch the sweeper's holder) unless this worker sweeps."""
        if self.nc is None:
            return False
        held = False if sweeping else await sentinel.attempt()
        if sweeping and sentinel.state.held:
            # Give it up now rather than let it lapse (its max age, 10 s): until another worker
            # holds it nobody watches this sweeper, and a death then waits for the heartbeat's
            # TTL and a new sweeper's trust (~40 s in `fleet bench --only seam`'s cold case).
            revision, sentinel.state = sentinel.state.revision, LeaseState()
            try:
                await kv.delete(SENTINEL, last=revision)
            except Exception as exc:  # renewed elsewhere meanwhile: it has a holder
                log.info("sentinel lease not given up: %s", exc)
        if held and (self._sentinel is None or self._sentinel.done()):
            log.info("this worker now holds the sentinel lease: it watches the sweeper's holder")
            # A dead sweeper's instances move once this worker takes its lease over (at most
            # the lease's max age later), without waiting for the heartbeat key's TTL.
            watch = DeathWatch(self.nc, self.node_id, lambda: self._sweeper_holder(kv),
                               "sentinel", on_dead=self._seen_dead, link_since=self.link_since)
            self._sentinel = started(watch.forever(), "sentinel death watch")
        elif not held and self._sentinel is not None:
            task, self._sentinel = self._sentinel, None
            await _stop(task)
        return held

    async def _sweeper_holder(self, kv: KeyValue) -> dict[str, list[str]]:
        """The sweeper's holder and the task messages it holds (probed even when it holds
        none: its death also stalls failover and any sharded group it runs a rank of)."""
        lease = await kv_get(kv, SWEEPER, budget_s=RENEW_BUDGET_S)
        holder = lease.value.decode() if lease is not None and lease.value else ""
        if not holder or holder == self.node_id:
            return {}
        entry = await kv_get(self.failover.nodes, holder, budget_s=RENEW_BUDGET_S)
        try:
            info = decode_model(NodeInfo, entry.value) if entry and entry.value else None
        except DecodeError:
            info = None
        return {holder: info.held_acks if info else []}

    def _seen_dead(self, node: str) -> None:
        """A watch saw `node` die: its instances move at once, and a lease it held is freed
        for another worker now rather than at the lease's max age (10 s without a sweeper,
        or without a sentinel)."""
        self.failover.declare_dead(node)
        if self._leases is not None:  # kept until done (a task nobody holds may be collected)
            task = started(_free_leases_of(self._leases, node, self._contend_now.set),
                           f"free the leases of {node}")
            self._freeing.add(task)
            task.add_done_callback(self._freeing.discard)

    def _busy_nodes(self) -> dict[str, list[str]]:
        """Every node whose heartbeat lists held task messages, as the watch last saw it, and
        every node running a rank of a sharded instance (its death stalls its group)."""
        declared = self.failover.declared  # handled already (the sentinel saw it die)
        return {node: info.held_acks for node, info in self.failover.live.items()
                if (info.held_acks or node in self.failover.ranked)
                and not (node in declared and info.at <= declared[node])}

    async def _run_duties(self) -> None:
        self.leading.set()
        jobs: list[Callable[[], Awaitable[None]]] = [
            self.failover.watch, self.failover.sweep_forever, self.capabilities.forever,
        ]
        if self.nc is not None:
            watch = DeathWatch(self.nc, self.node_id, _now(self._busy_nodes), "sweeper",
                               on_dead=self._seen_dead, link_since=self.link_since)
            jobs.append(watch.forever)
        if self.demand is not None:
            jobs.append(self.demand.sweep_forever)
        if self.janitor is not None:
            jobs.append(self.janitor.triage_forever)
        try:
            # Bounded: a job inside a nats-py call may drop its cancel (Python 3.11's
            # wait_for), and a plain TaskGroup then waited on it for ever when the lease was
            # lost or the worker stopped (a test's teardown hung 1 run in 3); the Supervisor
            # repeats the cancel (fleet.aio.cancel_and_wait). A job that fails stops them all.
            async with Supervisor("sweeper duties", bounded_s=CLOSE_WAIT_S) as duties:
                for job in jobs:
                    duties.forever(getattr(job, "__qualname__", "duty"), job, critical=True)
        except Exception as exc:
            log.warning("fleet-wide duties failed (%s); restarted at the next renewal", exc)
        finally:
            self.leading.clear()

    async def _stop_duties(self) -> None:
        task, self._duties = self._duties, None
        if task is None:
            return
        await _stop(task)
        self.failover.forget()  # its view of the nodes is stale from here on
        self.capabilities.written = None  # another sweeper may write meanwhile: read afresh


async def _free_leases_of(kv: KeyValue, node: str, on_freed: Callable[[], None]) -> None:
    """Delete each lease `node` holds, by compare-and-set (a renewal or a new holder since
    wins, and nothing is deleted); `on_freed` after each one deleted."""
    for name in (SWEEPER, SENTINEL):
        entry = await kv_get(kv, name, budget_s=RENEW_BUDGET_S)
        if entry is None or entry.value != node.encode():
            continue
        try:
            await kv.delete(name, last=entry.revision)
        except Exception as exc:  # renewed or taken meanwhile: it lives, or has a holder
            log.info("lease %s of %s not freed: %s", name, node, exc)
            continue
        log.warning("lease %s of dead node %s freed for another worker", name, node)
        on_freed()


async def _stop(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` and wait for its end, repeating the cancel (fleet.aio.cancel_and_wait):
    a loop around a nats-py request can drop a single cancel (its wait_for, Python 3.11), and
    this lease loop then awaited the task for ever. Seen in issue 24's seam bench: a worker
    SIGSTOPped 10 s lost its sentinel lease (the last line of its lease loop), never contended
    for it again although nobody held it, and the bench waited 300 s for the two leases."""
    if task is None:
        return
    if await cancel_and_wait([task]):
        log.warning("%s did not end within %.0f s of its cancel; left behind", task.get_name(),
                    CLOSE_WAIT_S)


def _now(
    read: Callable[[], dict[str, list[str]]],
) -> Callable[[], Awaitable[dict[str, list[str]]]]:
    """An in-memory reading as the awaitable a death watch's targets are."""
    async def targets() -> dict[str, list[str]]:
        return read()
    return targets
