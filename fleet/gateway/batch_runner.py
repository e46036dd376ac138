"""Which gateway runs which batch job: each job that is not done has a lease key in KV
FLEET_BATCH_LEASES. The gateway that creates a job holds its lease and starts it at once;
every gateway looks for lapsed leases every SCAN_S and takes one with compare-and-set, so
when its holder dies (SIGKILL, a lost host) another gateway goes on within LEASE_S + SCAN_S.
A holder renews every RENEW_S; one that cannot (it lost the lease, or NATS) stops its job.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import Any

from fleet.aio import CLOSE_WAIT_S, Supervisor, cancel_and_wait, started
from fleet.bus.batch_store import BatchStore
from fleet.errors import FleetError
from fleet.gateway.batch_job import Job, Policies
from fleet.gateway.batch_slack import Slack
from fleet.gateway.priority import OPEN
from fleet.gateway.service import Gateway
from fleet.wire.batches import BatchLease

log = logging.getLogger(__name__)

LEASE_S = 10.0
RENEW_S = 3.0
SCAN_S = 3.0


def may_take(lease: BatchLease | None, owner: str, now: float) -> bool:
    """A lease is ours to take when absent, already ours, or lapsed."""
    return lease is None or lease.owner == owner or lease.until <= now


class LeaseLost(Exception):
    pass


class BatchRunner:
    def __init__(self, gateway: Gateway, store: BatchStore,
                 policy: Policies = lambda _: OPEN) -> None:
        self.gateway = gateway
        self.store = store
        self.policy = policy
        self.owner = f"gw-{secrets.token_hex(6)}"
        self.jobs: dict[str, asyncio.Task[None]] = {}
        self.slack = Slack(gateway.backend.task_queue)
        self._scanner: asyncio.Task[None] | None = None
        self._supervisor: Supervisor | None = None

    async def start(self, owner: Supervisor | None = None) -> None:
        """The scanner, and the jobs from here on, as children of `owner` (the gateway's
        lifespan); without one, tasks of their own."""
        self._supervisor = owner
        self._scanner = self._spawn("batch scanner", self._scan_forever())

    async def close(self) -> None:
        """Stops the jobs here; their leases lapse and another gateway goes on."""
        left = await cancel_and_wait([*self.jobs.values(), *filter(None, [self._scanner])])
        if left:
            log.warning("%d batch task(s) did not stop within %.0f s", len(left), CLOSE_WAIT_S)

    def lease_for(self, batch_id: str) -> BatchLease:
        return BatchLease(batch_id=batch_id, owner=self.owner, until=time.time() + LEASE_S)

    def start_job(self, batch_id: str, revision: int) -> None:
        """Run a job whose lease this gateway holds at `revision`."""
        if batch_id not in self.jobs:
            task = self._spawn(f"batch {batch_id}", self._run(batch_id, revision))
            self.jobs[batch_id] = task
            task.add_done_callback(lambda _: self.jobs.pop(batch_id, None))

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        if self._supervisor is not None:
            return self._supervisor.spawn(name, coro)
        return started(coro, name)

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except FleetError as exc:
                log.warning("batch scan: %s", exc.message)
            except Exception:  # a bug: say so, and scan again (jobs must not stall silently)
                log.exception("batch scan failed")
            await asyncio.sleep(SCAN_S)

    async def scan(self) -> None:
        if not self.gateway.backend.connected:
            return
        for batch_id in await self.store.leased():
            if batch_id in self.jobs:
                continue
            found = await self.store.lease(batch_id)
            if found is None or not may_take(found[0], self.owner, time.time()):
                continue
            revision = await self.store.update_lease(self.lease_for(batch_id), found[1])
            if revision is not None:
                log.info("batch %s: lease taken over from %s", batch_id, found[0].owner)
                self.start_job(batch_id, revision)

    async def _run(self, batch_id: str, revision: int) -> None:
        job = Job(self.gateway, self.store, batch_id, self.slack, self.policy)
        try:
            async with asyncio.TaskGroup() as group:
                renewing = group.create_task(self._renew(batch_id, revision))
                await job.run()
                renewing.cancel()
            await self.store.end_lease(batch_id)
        except* LeaseLost:
            log.warning("batch %s: lease lost; another gateway goes on", batch_id)
        except* FleetError as group_error:
            for exc in group_error.exceptions:
                log.warning("batch %s stopped here (%s); its lease will lapse", batch_id, exc)
        except* Exception as group_error:  # a bug: logged whole; the lease lapses, others retry
            log.error("batch %s failed here", batch_id, exc_info=group_error)

    async def _renew(self, batch_id: str, revision: int) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            renewed = await self.store.update_lease(self.lease_for(batch_id), revision)
            if renewed is None:
                raise LeaseLost(batch_id)
            revision = renewed
