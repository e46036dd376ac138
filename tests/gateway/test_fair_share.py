"""Fair tenants at admission against a real nats-server: two FairShare objects stand for two
gateway replicas sharing KV FLEET_FAIRNESS. A tenant ahead of a waiting one is held until
the other is charged; a run where A asks 10x as often as B gives B about its weight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client

from fleet.bus.fairness import shares
from fleet.bus.provision import provision
from fleet.gateway.fair_share import (
    BUCKET,
    FairShare,
    backlogged,
    held_because,
    keyed_done,
    slots_held,
    tenant_token,
)
from fleet.wire.fairness import TenantShare

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def replicas(nats_url: str) -> AsyncIterator[tuple[FairShare, FairShare]]:
    nc = Client()
    await nc.connect(nats_url)
    try:
        await provision(nc)
        kv = await nc.jetstream().key_value(BUCKET)
        nc2 = Client()
        await nc2.connect(nats_url)
        one, two = FairShare(nc, kv, quantum=100.0), FairShare(nc2, kv, quantum=100.0)
        yield one, two
        await one.close()
        await two.close()
        await nc2.close()
    finally:
        await nc.close()


@pytest.mark.parametrize(("entries", "now", "waiting"), [
    ({"a": TenantShare(counter=1, waiting=2, at=100.0)}, 110.0, ["a"]),
    ({"a": TenantShare(counter=1, waiting=0, at=100.0)}, 110.0, []),
    ({"a": TenantShare(counter=1, waiting=2, at=100.0)}, 161.0, []),  # stale: a dead gateway
])
def test_backlogged(entries: dict[str, TenantShare], now: float, waiting: list[str]) -> None:
    assert backlogged(entries, now) == waiting


def share(counter: float, waiting: int, at: float = 100.0) -> TenantShare:
    return TenantShare(counter=counter, waiting=waiting, at=at)


@pytest.mark.parametrize(("entries", "queued_here", "why"), [
    ({"a": share(0, 1)}, 5, None),  # alone: nothing to be fair to, no cap
    ({"a": share(600, 1), "b": share(0, 1)}, 0, "ahead"),  # B waits and is 600 behind
    # B's requests all run (waiting 0): it is not backlogged, so A takes the free slots
    ({"a": share(600, 1), "b": share(0, 0)}, 0, None),
    ({"a": share(400, 1), "b": share(0, 1)}, 0, None),  # within the quantum
    # B present (its entry fresh) and served less: A keeps at most the cap queued
    ({"a": share(100, 1), "b": share(0, 0)}, 1, "queued"),
    ({"a": share(100, 1), "b": share(0, 0)}, 0, None),
    ({"a": share(100, 1), "b": share(0, 0, at=30.0)}, 1, None),  # B's entry stale: gone
    ({"a": share(0, 1), "b": share(0, 0)}, 1, None),  # even: nobody behind A
    ({"a": share(0, 1), "b": share(600, 1)}, 3, None),  # A behind: never held nor capped
])
def test_held_because(entries: dict[str, TenantShare], queued_here: int,
                      why: str | None) -> None:
    assert held_because(entries, "a", 110.0, 512.0, queued_here, cap=1) == why


def test_tenant_token() -> None:
    assert tenant_token("team-a") == "team-a"
    assert tenant_token("a.b c").startswith("b64-") and "." not in tenant_token("a.b c")


async def test_a_tenant_ahead_waits_for_the_other_across_replicas(
    replicas: tuple[FairShare, FairShare],
) -> None:
    one, two = replicas
    a = await one.admit("m", "default", "a", 1.0, 0)
    await a.settle(500)  # A was served 500 tokens; B never
    b = await two.admit("m", "default", "b", 1.0, 0)  # B waits now (on the other replica)
    held = asyncio.ensure_future(one.admit("m", "default", "a", 1.0, 0))
    done, _ = await asyncio.wait([held], timeout=1.5)
    assert not done  # A is 500 ahead of B, who waits: held
    await b.settle(450)  # B served: within the quantum of A again
    second = await asyncio.wait_for(held, 10)
    await second.settle(0)


async def test_a_tenant_whose_requests_all_run_holds_nobody_back(
    replicas: tuple[FairShare, FairShare],
) -> None:
    """Work-conserving: B's one request waits, so A (600 ahead) is held; once a runner takes
    B's request, B has nothing waiting and A's next request goes at once (before, a running
    request counted as waiting and A was held until B's ended, leaving slots idle)."""
    one, two = replicas
    a = await one.admit("m", "default", "a", 1.0, 0)
    await a.settle(600)
    b = await two.admit("m", "default", "b", 1.0, 0)
    held = asyncio.ensure_future(one.admit("m", "default", "a", 1.0, 0))
    done, _ = await asyncio.wait([held], timeout=1.5)
    assert not done  # B waits and A is 600 ahead
    b.running()
    second = await asyncio.wait_for(held, 10)  # B runs: A goes though far ahead
    assert (await _entry(one, "m.default.b")).waiting == 0
    await second.settle(0)
    await b.settle(100)
    assert (await _entry(two, "m.default.b")).waiting == 0  # ran: its end leaves it at 0


async def test_a_flooding_tenant_gets_its_weight(replicas: tuple[FairShare, FairShare]) -> None:
    """A keeps 60 requests going, B 6 (both always backlogged), through one server of 2 slots
    taking what was admitted in order; 40 tokens each, weights 1 and 3. A floods first, alone
    (its 60 requests all queue: the slack is its), then B comes: once A's queued requests are
    served, B's share of the tokens served is near 3/4 (first come, first served: 6/66)."""
    one, two = replicas
    served = {"a": 0, "b": 0}
    weights = {"a": 1.0, "b": 3.0}
    slots = asyncio.Semaphore(2)  # the worker: admitted requests wait their turn in order
    stop = asyncio.Event()
    marks: dict[str, dict[str, int]] = {}
    done = asyncio.Event()

    async def client(fair: FairShare, tenant: str) -> None:
        while not stop.is_set():
            ticket = await fair.admit("m", "batch", tenant, weights[tenant], 40)
            async with slots:
                ticket.running()  # a runner accepted it
                await asyncio.sleep(0.03)  # stands for the engine serving the request
            served[tenant] += 40
            await ticket.settle(40)
            if served["b"] >= 40 * 10:  # A's head start is served: measure from here
                marks.setdefault("from", dict(served))
            if served["b"] >= 40 * 50:
                marks.setdefault("to", dict(served))
                done.set()

    clients = [asyncio.ensure_future(client(one if i % 2 else two, "a")) for i in range(60)]
    await asyncio.sleep(0.5)  # A alone for a while (a head start, not a synchronisation)
    clients += [asyncio.ensure_future(client(two if i % 2 else one, "b")) for i in range(6)]
    try:
        await asyncio.wait_for(done.wait(), 90)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 60)
    window = {t: marks["to"][t] - marks["from"][t] for t in served}
    assert 0.6 < shares(window)["b"] < 0.9, (window, served)


async def test_a_write_of_running_is_counted_once_in_the_slots_held(
    replicas: tuple[FairShare, FairShare],
) -> None:
    """A tenant's `run` and `leave` writes are heard on the bucket's subject before their
    answer comes; the slots the tenant holds, as the replica counts them at every change of
    its view, count each once: before, a leave counted twice made a slot look free to the
    other tenant, and a run counted twice put the tenant over its share, so the last free
    slot was not kept for it (fleet.gateway.fair_slots)."""
    one, _ = replicas
    first = await one.admit("m", "default", "b", 1.0, 0)
    second = await one.admit("m", "default", "b", 1.0, 0)
    view = one.views["m.default"]
    counted: list[int] = []
    wake = view.wake
    loop = asyncio.get_running_loop()

    def count() -> None:
        counted.append(slots_held(view.shares, "b", time.time(), one.holding("m.default"))
                       [0]["b"])

    def counting() -> None:  # every change of what the replica counts passes here
        loop.call_soon(count)  # as a held request woken by it would count: once it runs
        wake()

    view.wake = counting  # type: ignore[method-assign]
    first.running()
    assert first._run is not None and await first._run
    assert counted and set(counted) == {2}, counted  # one running, one queued
    counted.clear()
    await first.settle(5)
    assert counted and set(counted) == {1}, counted  # the queued one
    await second.settle(0)
    assert (await _entry(one, "m.default.b")).running == 0


async def _entry(fair: FairShare, key: str) -> TenantShare:
    return TenantShare.model_validate_json((await fair.kv.get(key)).value or b"")


async def test_a_batch_line_taken_over_before_it_ended_is_charged_once(
    replicas: tuple[FairShare, FairShare],
) -> None:
    """Replica one admits a batch line (its estimate, 100, charged) and dies with it running;
    replica two takes the job over and runs the line again under the same task id: it is not
    held (though its tenant is far ahead of a waiting one) and not charged again, and its end
    charges what it served once (counter 300, not 400) and closes the one join."""
    one, two = replicas
    b = await two.admit("m", "batch", "b", 1.0, 0)  # B waits: a tenant ahead of it is held
    await one.admit("m", "batch", "a", 1.0, 100, key="job-1-0")  # one's holder dies here
    shared = await _entry(one, "m.batch.a")
    assert (shared.counter, shared.waiting, shared.charged) == (100, 1, {"job-1-0": 100})
    forced = await two.admit("m", "batch", "a", 1.0, 1000)  # now A runs 1,100 ahead of B
    taken = await asyncio.wait_for(two.admit("m", "batch", "a", 1.0, 100, key="job-1-0"), 1.0)
    await taken.settle(300)
    shared = await _entry(two, "m.batch.a")
    assert (shared.counter, shared.waiting) == (1100 + 200, 1)  # the forced one still waits
    assert (shared.charged, shared.settled) == ({}, ["job-1-0"])
    await taken.forget()
    assert (await _entry(two, "m.batch.a")).settled == []
    await forced.settle(1000)
    await b.settle(0)


async def test_a_batch_line_settled_before_its_result_was_recorded_is_not_charged_again(
    replicas: tuple[FairShare, FairShare],
) -> None:
    """Replica one settles a line (300 served) and dies before recording its result; replica
    two runs it again (a replay of its events): no join, no charge, and its settle charges
    nothing."""
    one, two = replicas
    first = await one.admit("m", "batch", "a", 1.0, 100, key="job-2-7")
    await first.settle(300)
    again = await two.admit("m", "batch", "a", 1.0, 100, key="job-2-7")
    await again.settle(300)
    shared = await _entry(two, "m.batch.a")
    assert (shared.counter, shared.waiting, shared.settled) == (300, 0, ["job-2-7"])
    await again.forget()
    await first.forget()  # the dead replica's forget, had it come: nothing left to drop
    assert (await _entry(one, "m.batch.a")).settled == []


@pytest.mark.parametrize(("charged", "settled", "change", "done"), [
    ({}, [], "join", None),  # a new line: joins
    ({"k": 5}, [], "join", False),  # admitted by the holder before: no join, no turn
    ({}, ["k"], "join", False),
    ({"k": 5}, [], "start", True),  # charged already: no second charge
    ({}, [], "start", None),
    ({"k": 5}, [], "leave", None),  # settles: served less 5
    ({}, ["k"], "leave", True),  # settled already: nothing
    ({}, [], "leave", True),  # settled and forgotten by another runner: nothing
    ({}, ["k"], "forget", None),
    ({}, [], "forget", True),
])
def test_keyed_done(charged: dict[str, int], settled: list[str], change: str,
                    done: bool | None) -> None:
    share = TenantShare(counter=0, waiting=1, at=0.0, charged=dict(charged), settled=settled)
    assert keyed_done(share, change, "k") is done
