"""The reserve of fair tenants by slots (fleet.gateway.fair_slots): table tests of the pure
rule, and against a real nats-server two FairShare replicas that see each other's running
requests in KV: a tenant holding its share of the slots leaves the last free one to a
tenant below its share, and takes it once that tenant's request ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from nats.aio.client import Client

from fleet.bus.provision import provision
from fleet.gateway.fair_share import BUCKET, FairShare, View, held_because, slots_held
from fleet.gateway.fair_slots import entitled, kept_for
from fleet.wire.fairness import TenantShare

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("slots", "weights", "share"), [
    (16, {"a": 1.0, "b": 1.0}, {"a": 8, "b": 8}),
    (16, {"a": 1.0, "b": 2.0}, {"a": 5, "b": 11}),  # the slot left to the larger remainder
    (16, {"a": 1.0}, {"a": 16}),
    (3, {"a": 1.0, "b": 1.0}, {"a": 2, "b": 1}),  # a tie: by name
    (16, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 6, "b": 5, "c": 5}),
    (4, {"a": 0.0}, {"a": 0}),
])
def test_entitled(slots: int, weights: dict[str, float], share: dict[str, int]) -> None:
    assert entitled(slots, weights) == share
    assert sum(share.values()) in (slots, 0)


@pytest.mark.parametrize(("held", "weights", "slots", "kept"), [
    ({"a": 8, "b": 7}, {}, 16, "b"),  # the last free slot is B's: A holds its 8
    ({"a": 7, "b": 7}, {}, 16, None),  # 2 free: beyond the reserve, anyone takes one
    ({"a": 7, "b": 8}, {}, 16, None),  # A below its share: its request goes
    # none free: A's request would queue in the broker and take the slot B's next needs
    ({"a": 9, "b": 7}, {}, 16, "b"),
    ({"a": 8, "b": 8}, {}, 16, "b"),
    ({"a": 7, "b": 9}, {}, 16, None),  # A below its share
    ({"a": 8, "b": 9}, {}, 16, None),  # B over its share: nobody to keep a slot for
    ({"a": 15}, {}, 16, None),  # alone
    ({"a": 6, "b": 9}, {"b": 2.0}, 16, "b"),  # B weighs 2: its share is 11 of 16
    ({"a": 5, "b": 10}, {"b": 2.0}, 16, "b"),
    ({"a": 4, "b": 11}, {"b": 2.0}, 16, None),  # A below its 5
    ({"a": 12, "b": 3}, {}, 0, None),  # slots not known: no reserve
    ({"a": 3, "b": 0, "c": 0}, {}, 4, "b"),  # present tenants with nothing running
])
def test_kept_for(held: dict[str, int], weights: dict[str, float], slots: int,
                  kept: str | None) -> None:
    assert kept_for(held, weights, "a", slots) == kept


def share(counter: float = 0.0, waiting: int = 0, running: int = 0, at: float = 100.0,
          weight: float = 1.0) -> TenantShare:
    return TenantShare(counter=counter, waiting=waiting, running=running, at=at, weight=weight)


@pytest.mark.parametrize(("entries", "queued", "held"), [
    ({"a": share(running=3), "b": share(running=2)}, {}, {"a": 3, "b": 2}),
    ({"a": share(running=3), "b": share(running=2)}, {"a": 1}, {"a": 4, "b": 2}),
    ({"a": share(), "b": share(waiting=1)}, {}, {"a": 0, "b": 0}),  # B waits: present
    ({"a": share(), "b": share()}, {}, {"a": 0}),  # B has nothing: not present
    ({"a": share(), "b": share(running=4, at=30.0)}, {}, {"a": 0}),  # B stale: gone
    ({"a": share(), "b": share()}, {"b": 1}, {"a": 0, "b": 1}),  # B's queued here
])
def test_slots_held(entries: dict[str, TenantShare], queued: dict[str, int],
                    held: dict[str, int]) -> None:
    assert slots_held(entries, "a", 110.0, queued)[0] == held


@pytest.mark.parametrize(("entries", "slots", "why"), [
    ({"a": share(running=8), "b": share(running=7)}, 16, "reserved"),
    ({"a": share(running=8), "b": share(running=7)}, 0, None),  # slots not known
    ({"a": share(running=7), "b": share(running=7)}, 16, None),
    ({"a": share(running=8), "b": share(running=7, weight=2.0)}, 16, "reserved"),
    # A at its share and ahead: held as ahead (checked first)
    ({"a": share(counter=600, running=8), "b": share(waiting=1, running=7)}, 16, "ahead"),
    # A below its share is not held as ahead, however far: the free slots are kept for it,
    # and holding it too left them idle while B was held by the reserve
    ({"a": share(counter=600, running=1), "b": share(waiting=1)}, 16, None),
    ({"a": share(counter=600, running=7), "b": share(waiting=1, running=8)}, 16, None),
    ({"a": share(counter=600, running=1), "b": share(waiting=1)}, 0, "ahead"),  # not known
])
def test_held_because_reserved(entries: dict[str, TenantShare], slots: int,
                               why: str | None) -> None:
    assert held_because(entries, "a", 110.0, 512.0, 0, cap=1, slots=slots) == why


@pytest.mark.parametrize(("entries", "slots", "queued_here", "why"), [
    # A is served more than B and has one request queued here: capped, as before ...
    ({"a": share(counter=100, running=8), "b": share(running=7)}, 0, 1, "queued"),
    ({"a": share(counter=100, running=8), "b": share(running=6)}, 16, 1, "queued"),
    # ... unless it holds fewer than its share: its requests are within what is kept for it
    ({"a": share(counter=100, running=5), "b": share(running=7)}, 16, 1, None),
    ({"a": share(counter=100, running=6), "b": share(running=7)}, 16, 2, "queued"),  # 8 held
])
def test_a_tenant_within_its_share_is_not_capped(entries: dict[str, TenantShare], slots: int,
                                                 queued_here: int, why: str | None) -> None:
    assert held_because(entries, "a", 110.0, 512.0, queued_here, cap=1, slots=slots) == why


async def test_a_write_of_running_under_way_counts_at_once() -> None:
    """B's request ended and its leave is being written: B's next request is not held as
    at its share meanwhile (B 2 of 4 slots in KV, 1 in fact); a run being written counts
    at once the other way."""
    fair = FairShare(None, None, slots=lambda model: 4)  # type: ignore[arg-type]
    view = View()
    now = time.time()
    view.shares = {"a": share(running=2, at=now), "b": share(running=2, at=now)}
    fair.views["m.default"] = view
    assert fair._held(view, "m.default", "b") == "reserved"  # as KV says: no slot free
    fair.move("m.default", "b", -1)
    assert fair._held(view, "m.default", "b") is None
    fair.move("m.default", "b", 1)
    fair.move("m.default", "a", -1)  # A's leave under way: A's next takes its slot back
    assert fair._held(view, "m.default", "a") is None
    assert fair._held(view, "m.default", "b") == "reserved"  # kept for A, below its share
    fair.move("m.default", "a", 1)
    fair.move("m.default", "a", 1)  # A's third request runs, its write not yet done
    assert fair._held(view, "m.default", "a") == "reserved"


@pytest.fixture
async def replicas(nats_url: str) -> AsyncIterator[tuple[FairShare, FairShare]]:
    nc, nc2 = Client(), Client()
    await nc.connect(nats_url)
    await nc2.connect(nats_url)
    try:
        await provision(nc)
        kv = await nc.jetstream().key_value(BUCKET)
        one = FairShare(nc, kv, slots=lambda model: 4)
        two = FairShare(nc2, kv, slots=lambda model: 4)
        yield one, two
        await one.close()
        await two.close()
    finally:
        await nc.close()
        await nc2.close()


async def _seen(fair: FairShare, tenant: str, holds: Callable[[TenantShare], bool]) -> None:
    """Until `fair`'s view of (m, default) shows `tenant`'s entry as `holds` says (another
    replica's write reaches it by the bucket's subject)."""
    view = await fair._view("m.default")
    async with asyncio.timeout(10):
        while not ((mine := view.shares.get(tenant)) is not None and holds(mine)):
            await view.changed.wait()


async def test_the_last_free_slot_waits_for_the_tenant_below_its_share(
    replicas: tuple[FairShare, FairShare],
) -> None:
    """4 slots, equal weights: A runs 2 (its share), B 1; A's next request is held for the
    one free slot, B's goes at once (as replica one sees it, B still holds 1, below its
    share); when B's running request ends, 2 slots are free and A's goes."""
    one, two = replicas
    running_a = [await one.admit("m", "default", "a", 1.0, 0) for _ in range(2)]
    for ticket in running_a:
        ticket.running()
    b = await two.admit("m", "default", "b", 1.0, 0)
    b.running()
    await _seen(one, "b", lambda s: s.running == 1)
    await _seen(one, "a", lambda s: s.running == 2)
    held = asyncio.ensure_future(one.admit("m", "default", "a", 1.0, 0))
    b_next = await asyncio.wait_for(two.admit("m", "default", "b", 1.0, 0), 5)
    # B's admission went while A's request waits in its held turn (not merely unscheduled)
    assert not held.done() and one._turns[("m.default", "a")].locked()
    await b.settle(10)  # B's first request ends: 2 slots free as replica one sees them
    a_next = await asyncio.wait_for(held, 10)
    for ticket in [*running_a, b_next, a_next]:
        await ticket.settle(10)
    for tenant in ("a", "b"):
        entry = TenantShare.model_validate_json((await one.kv.get(f"m.default.{tenant}")).value
                                                or b"")
        assert (entry.running, entry.waiting) == (0, 0)
