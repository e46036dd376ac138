"""A worker that holds the sentinel lease and then takes the sweeper's gives the sentinel up at
once, by an explicit delete (fleet.worker.sweeper `_sentinel_round`), rather than letting it
lapse at the bucket's max age: until another worker holds it nobody watches this sweeper
(`fleet bench --only seam`'s cold case). On a real server: a delete (DEL) of the sentinel key
tells the give-up from the lapse, which the server marks as a purge (PURGE, its MaxAge marker).
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from fleet.aio import started
from fleet.bus.kv_calls import kv_create, kv_get
from fleet.wire import subjects
from fleet.worker.failover import Failover
from fleet.worker.sweeper import LEASES_BUCKET, SENTINEL, SWEEPER, FleetDuties

WITHIN_S = 30.0  # generous (a shared box): the lease's rounds are 2 s apart
OTHER = "other-node"  # the sweeper's holder before this worker; it never beats or answers


async def next_entry(watcher: object, key: str, timeout: float) -> object:
    """The next update of `key` on `watcher` (a KV watch), skipping the initial-values end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        entry = await watcher.updates(timeout=max(0.01, deadline - loop.time()))  # type: ignore[attr-defined]
        if entry is not None and entry.key == key:
            return entry


async def test_taking_the_sweeper_lease_gives_the_sentinel_lease_up_at_once(
    provisioned_nc: Client,
) -> None:
    js = provisioned_nc.jetstream()
    leases = await js.key_value(LEASES_BUCKET)
    nodes = await js.key_value(subjects.NODES_BUCKET)
    instances = await js.key_value(subjects.INSTANCES_BUCKET)
    # Another node sweeps, so this worker's first round takes the sentinel lease.
    assert await kv_create(leases, SWEEPER, OTHER.encode(), budget_s=5.0) is not None
    watcher = await leases.watch(SENTINEL)
    duties = FleetDuties(js, "me", Failover(js, nodes, instances, {}, self_id="me"),
                         nc=provisioned_nc)
    task = started(duties.forever(), "fleet duties under test")
    try:
        taken = await next_entry(watcher, SENTINEL, WITHIN_S)
        assert taken.value == b"me" and taken.operation is None  # type: ignore[attr-defined]
        # The other sweeper's lease goes (as a dead holder's is freed): this worker takes it.
        entry = await kv_get(leases, SWEEPER, budget_s=5.0)
        if entry is not None and entry.value == OTHER.encode():
            await leases.delete(SWEEPER, last=entry.revision)
        await asyncio.wait_for(duties.leading.wait(), WITHIN_S)
        # Then the sentinel key is deleted by its holder, not left to lapse at its max age
        # (10 s, a PURGE marker); renewals of it by this worker would be puts of b"me".
        gone = await next_entry(watcher, SENTINEL, WITHIN_S)
        while gone.operation is None:  # type: ignore[attr-defined]  # a renewal before the take
            assert gone.value == b"me", gone  # type: ignore[attr-defined]
            gone = await next_entry(watcher, SENTINEL, WITHIN_S)
        assert gone.operation == "DEL", gone  # type: ignore[attr-defined]
        held = await kv_get(leases, SWEEPER, budget_s=5.0)
        assert held is not None and held.value == b"me"
    finally:
        task.cancel()
        # The duties end when cancelled: a job inside a nats-py call may drop a cancel (Python
        # 3.11's wait_for), and this teardown hung 1 run in 2-3 while the duties were a plain
        # TaskGroup (they are a bounded Supervisor now, which repeats the cancel).
        done, _ = await asyncio.wait({task}, timeout=10.0)
        await watcher.stop()
        assert done, "the fleet duties did not end when cancelled"
