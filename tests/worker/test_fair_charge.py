"""Fair tenants for tasks published straight on NATS: the worker that ends one charges what
it served to its tenant's entry in KV FLEET_FAIRNESS (fleet.worker.fair_charge). The rules as
tables; then, against a real nats-server, real task messages (with and without the gateway's
header) charged once each, by the weight a gateway wrote, and a gateway's fair turn holding
the tenant that was served through NATS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.aio import Supervisor
from fleet.bus.fairness import charged_by_publisher
from fleet.bus.provision import provision
from fleet.gateway.fair_share import BUCKET, FairShare
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskFinished, Usage
from fleet.wire.fairness import CHARGED_HEADER, TenantShare
from fleet.wire.tasks import TextGeneration
from fleet.worker.acks import Stage
from fleet.worker.endings import Endings
from fleet.worker.fair_charge import (
    SETTLED_MAX,
    Charge,
    FairCharges,
    charge_of,
    charged,
    marked,
    unmarked,
)

pytestmark = pytest.mark.timeout(120)


def finished(prompt: int, completion: int, task_id: str = "t-1") -> TaskFinished:
    return TaskFinished(task_id=task_id, at=0.0, status="completed",
                        usage=Usage(prompt_tokens=prompt, completion_tokens=completion))


def task_bytes(tenant: str | None, task_id: str = "t-1") -> bytes:
    return encode(TextGeneration(task_id=task_id, model="m", prompt="hi", tenant=tenant))


@pytest.mark.parametrize(("subject", "priority", "tenant"), [
    ("fleet.tasks.m", "default", None),
    ("fleet.tasks.m.batch", "batch", None),
    ("fleet.tasks.m.interactive", "interactive", None),
    ("fleet.tasks.m.default.a", "default", "a"),  # a tenant lane (fleet.worker.lanes)
    ("fleet.tasks.m.batch.b64-eA", "batch", "b64-eA"),
])
def test_class_and_lane_of_subject(subject: str, priority: str, tenant: str | None) -> None:
    assert subjects.priority_of_task_subject(subject) == priority
    assert subjects.tenant_of_task_subject(subject) == tenant
    if tenant is not None:
        assert subjects.lane("m", priority, tenant) == subject


@pytest.mark.parametrize(("subject", "headers", "data", "done", "charge"), [
    ("fleet.tasks.m", None, task_bytes("a"), finished(10, 30), Charge("m.default.a", 40)),
    ("fleet.tasks.m.batch", {}, task_bytes("a"), finished(10, 30), Charge("m.batch.a", 40)),
    # a gateway's task: its fair turn charges it
    ("fleet.tasks.m", {CHARGED_HEADER: "1"}, task_bytes("a"), finished(10, 30), None),
    ("fleet.tasks.m", None, task_bytes(None), finished(10, 30), None),  # no tenant
    # a plain client's JSON, spaced and with a null tenant: decoded, as the codec would
    ("fleet.tasks.m", None, b'{"type": "text_generation", "task_id": "t-1", "model": "m", '
     b'"prompt": "hi", "tenant" : "a"}', finished(10, 30), Charge("m.default.a", 40)),
    ("fleet.tasks.m", None, b'{"type": "text_generation", "task_id": "t-1", "model": "m", '
     b'"prompt": "hi", "tenant": null}', finished(10, 30), None),
    ("fleet.tasks.m", None, task_bytes("a"), finished(0, 0), None),  # served nothing
    ("fleet.tasks.m", None, b"not json", finished(10, 30), None),
    # a lane's task is charged to the lane's tenant, whatever its body says
    ("fleet.tasks.m.default.b", None, task_bytes("a"), finished(10, 30),
     Charge("m.default.b", 40)),
    ("fleet.tasks.m.batch.b", None, task_bytes(None), finished(1, 1), Charge("m.batch.b", 2)),
    ("fleet.tasks.m.batch.b", {CHARGED_HEADER: "1"}, task_bytes(None), finished(1, 1), None),
])
def test_charge_of(subject: str, headers: dict[str, str] | None, data: bytes,
                   done: TaskFinished, charge: Charge | None) -> None:
    expected = None if charge is None else replace(charge, task_id="t-1")
    assert charge_of(subject, headers, data, done) == expected


MINE = TenantShare(counter=10, waiting=2, at=5.0, weight=2.0, charged={"x": 3},
                   settled=["line-1"])


@pytest.mark.parametrize(("mine", "task_id", "tokens", "after"), [
    # not charged yet: counter + tokens over the weight, marked; the gateway's fields kept
    (MINE, "t-1", 40, MINE.model_copy(update={"counter": 30.0,
                                              "settled": ["line-1", "t-1"]})),
    (MINE.model_copy(update={"settled": ["line-1", "t-1"]}), "t-1", 40, None),  # charged
    (TenantShare(counter=0, waiting=0, at=0, settled=[f"s{i}" for i in range(SETTLED_MAX)]),
     "t-1", 4, TenantShare(counter=4.0, waiting=0, at=0,
                           settled=[*(f"s{i}" for i in range(1, SETTLED_MAX)), "t-1"])),
])
def test_marked(mine: TenantShare, task_id: str, tokens: int, after: TenantShare | None) -> None:
    assert marked(mine, task_id, tokens) == after


@pytest.mark.parametrize(("mine", "task_id", "after"), [
    (MINE.model_copy(update={"settled": ["line-1", "t-1"]}), "t-1", MINE),
    (MINE, "t-1", None),  # no mark: nothing to write
])
def test_unmarked(mine: TenantShare, task_id: str, after: TenantShare | None) -> None:
    assert unmarked(mine, task_id) == after


def test_charged_divides_by_the_weight_and_leaves_the_gateways_fields() -> None:
    mine = TenantShare(counter=10, waiting=2, at=5.0, weight=4.0, charged={"x": 3})
    assert charged(mine, 40) == mine.model_copy(update={"counter": 20.0})


def test_the_gateway_marks_only_a_tenants_task() -> None:
    assert charged_by_publisher(None) == {}
    assert charged_by_publisher("a") == {CHARGED_HEADER: "1"}


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Client]:
    nc = Client()
    await nc.connect(nats_url)
    try:
        await provision(nc)
        yield nc
    finally:
        await nc.close()


async def received(nc: Client, subject: str, data: bytes,
                   headers: dict[str, str] | None = None) -> Msg:
    """A real message as a worker gets one (core NATS here: the charge reads only its
    subject, headers and body)."""
    sub = await nc.subscribe(subject)
    await nc.publish(subject, data, headers=headers)
    msg = await sub.next_msg(timeout=5)
    await sub.unsubscribe()
    return msg


async def test_nats_published_tasks_are_charged_once_each_by_the_gateways_weight(
    bus: Client,
) -> None:
    kv = await bus.jetstream().key_value(BUCKET)
    # a gateway admitted A before (weight 2): its entry says so
    await kv.put("m.batch.a", TenantShare(counter=5.0, waiting=1, at=7.0,
                                          weight=2.0).model_dump_json().encode())
    charges = FairCharges(bus.jetstream())
    nats_task = await received(bus, "fleet.tasks.m.batch", task_bytes("a"))
    gateway_task = await received(bus, "fleet.tasks.m.batch", task_bytes("a"),
                                  charged_by_publisher("a"))
    await charges.after(nats_task, finished(10, 30))
    await charges.after(gateway_task, finished(10, 30))
    await charges.after(None, finished(10, 30))  # a task with no held message
    entry = TenantShare.model_validate_json((await kv.get("m.batch.a")).value or b"")
    assert (entry.counter, entry.waiting, entry.at) == (25.0, 1, 7.0)  # 5 + 40 / 2
    # a tenant no gateway has seen: created, weight 1; concurrent charges all land
    others = [await received(bus, "fleet.tasks.m", task_bytes("b", f"b-{i}"))
              for i in range(5)]
    await asyncio.gather(*(charges.after(msg, finished(1, 9, f"b-{i}"))
                           for i, msg in enumerate(others)))
    entry = TenantShare.model_validate_json((await kv.get("m.default.b")).value or b"")
    assert (entry.counter, entry.waiting, entry.settled) == (50.0, 0, [])  # marks dropped
    assert charges.charged == 6
    # the same task's ending again (a redelivery after a death before the ack): the mark
    # left by the first ending makes the charge once; once acked, the mark goes
    again = await received(bus, "fleet.tasks.m", task_bytes("b", "b-9"))
    first = await charges.before_ack(again, finished(1, 9, "b-9"))
    assert await charges.before_ack(again, finished(1, 9, "b-9")) == first
    entry = TenantShare.model_validate_json((await kv.get("m.default.b")).value or b"")
    assert (entry.counter, entry.settled, charges.found) == (60.0, ["b-9"], 1)
    await charges.after_ack(first)
    entry = TenantShare.model_validate_json((await kv.get("m.default.b")).value or b"")
    assert (entry.counter, entry.settled) == (60.0, [])


async def test_a_tenant_served_through_nats_waits_its_turn_at_the_gateway(bus: Client) -> None:
    """B waits at a gateway; A was served 1,000 tokens by tasks published straight on NATS:
    A's next request through the gateway is held until B is charged near A."""
    fair = FairShare(bus, await bus.jetstream().key_value(BUCKET), quantum=100.0)
    try:
        b = await fair.admit("m", "default", "b", 1.0, 0)
        for i in range(2):
            msg = await received(bus, "fleet.tasks.m", task_bytes("a", f"a-{i}"))
            await FairCharges(bus.jetstream()).after(msg, finished(100, 400, f"a-{i}"))
        held = asyncio.ensure_future(fair.admit("m", "default", "a", 1.0, 0))
        done, _ = await asyncio.wait([held], timeout=1.5)
        assert not done  # 1,000 ahead of B, who waits: held
        await b.settle(950)
        await (await asyncio.wait_for(held, 10)).settle(0)
    finally:
        await fair.close()


class _Output:
    async def finish(self, event: TaskFinished) -> TaskFinished:
        return event  # stored


class _Acks:
    """Records each verb with the counter it found; the first one fails (an ack lost in a
    broker election: the message is redelivered, as after a death before the ack)."""

    def __init__(self, kv: object) -> None:
        self.kv = kv
        self.settled: list[tuple[str | None, float, bool]] = []

    async def settle(self, task_id: str | None, msg: Msg, stage: object) -> bool:
        entry = await self.kv.get("m.interactive.a")  # type: ignore[attr-defined]
        sent = bool(self.settled)
        self.settled.append((task_id, TenantShare.model_validate_json(entry.value).counter,
                             sent))
        return sent


class _Spans:
    def finished(self, event: object) -> None:
        pass

    def settled(self, task_id: str | None, verb: str) -> None:
        pass


async def test_an_ending_charges_before_its_ack_once_whoever_acks(bus: Client) -> None:
    """The worker's ending (fleet.worker.endings) stores the terminal, charges, then acks;
    its ack fails, so the mark stays; the redelivery of the finished task (Endings.settle
    with its stored terminal) finds the mark, charges nothing more, acks, drops the mark."""
    kv = await bus.jetstream().key_value(BUCKET)
    acks = _Acks(kv)
    async with Supervisor("test") as owner:
        endings = Endings(_Output(), acks, _Spans(), owner, "n1",  # type: ignore[arg-type]
                          FairCharges(bus.jetstream()))
        msg = await received(bus, "fleet.tasks.m.interactive", task_bytes("a"))
        endings.finish(finished(3, 4), msg)
        await endings.wait(10)
        entry = TenantShare.model_validate_json((await kv.get("m.interactive.a")).value or b"")
        assert entry.settled == ["t-1"]  # not acked: the mark stays for the redelivery
        endings.settle("t-1", msg, Stage.REDELIVERED_FINISHED, finished(3, 4))
        await endings.wait(10)
    entry = TenantShare.model_validate_json((await kv.get("m.interactive.a")).value or b"")
    assert acks.settled == [("t-1", 7.0, False), ("t-1", 7.0, True)]  # charged before each
    assert (entry.counter, entry.settled) == (7.0, [])
