"""Tenant lanes (fleet.worker.lanes): which lanes of a class have tasks, whose counter is
raised, and whose task each free slot takes, as tables; the subjects and durable names."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.provision import provision
from fleet.bus.roles import FAIRNESS
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskFinished, Usage
from fleet.wire.fairness import TenantShare
from fleet.wire.tasks import TextGeneration
from fleet.worker.fair_charge import FairCharges
from fleet.worker.lanes import CREDIT, LOOK_EVERY_S, backlog, fair_order, lifts, reads_counts
from fleet.worker.pulls import TaskPuller
from tests.secured import as_role, shipped_auth_server


@pytest.mark.parametrize(("counts", "priority", "lanes"), [
    ({}, "default", {}),
    ({"fleet.tasks.m.default.a": 3, "fleet.tasks.m.default.b": 1}, "default", {"a": 3, "b": 1}),
    # other classes' lanes, a class's shared subject, an emptied lane: not this class's
    ({"fleet.tasks.m.batch.a": 3, "fleet.tasks.m.default": 5, "fleet.tasks.m.default.b": 0},
     "default", {}),
    ({"fleet.tasks.m.batch.a": 3, "fleet.tasks.m.interactive.a": 1}, "batch", {"a": 3}),
])
def test_backlog(counts: dict[str, int], priority: str, lanes: dict[str, int]) -> None:
    assert backlog(counts, priority) == lanes


@pytest.mark.parametrize(("counters", "lanes", "raised"), [
    ({}, [], {}),
    ({"a": 0.0}, ["a"], {}),  # alone: nobody to be behind
    ({"a": 5000.0, "b": 0.0}, ["a", "b"], {"b": 5000.0 - CREDIT}),  # b idled while a ran
    ({"a": 5000.0, "b": 4600.0}, ["a", "b"], {}),  # within the credit
    ({"a": 5000.0}, ["a", "b"], {"b": 5000.0 - CREDIT}),  # b has no entry yet: 0
    # raised to the least of the others, not the most
    ({"a": 5000.0, "b": 1000.0, "c": 0.0}, ["a", "b", "c"], {"c": 1000.0 - CREDIT}),
    ({"a": 5000.0, "b": 0.0}, ["a"], {}),  # b has no tasks: not lifted (lifted when it has)
])
def test_lifts(counters: dict[str, float], lanes: list[str], raised: dict[str, float]) -> None:
    assert lifts(counters, lanes) == raised


@pytest.mark.parametrize(("counters", "weights", "lanes", "picks", "order"), [
    ({}, {}, [], 3, []),
    ({"a": 0.0, "b": 0.0}, {}, ["a", "b"], 4, ["a", "b", "a", "b"]),  # ties by name
    ({"a": 1000.0, "b": 0.0}, {}, ["a", "b"], 3, ["b", "b", "b"]),  # b behind by 4 picks
    ({"a": 600.0, "b": 0.0}, {}, ["a", "b"], 4, ["b", "b", "b", "a"]),
    # weight 4: each of b's picks costs it a quarter as much
    ({"a": 0.0, "b": 0.0}, {"b": 4.0}, ["a", "b"], 6, ["a", "b", "b", "b", "b", "a"]),
    ({"a": 0.0, "b": 0.0}, {}, ["b"], 2, ["b", "b"]),  # only lanes with tasks
])
def test_fair_order(counters: dict[str, float], weights: dict[str, float], lanes: list[str],
                    picks: int, order: list[str]) -> None:
    assert fair_order(counters, weights, lanes, picks) == order


@pytest.mark.parametrize(("seen", "read", "reads"), [
    (None, None, True),  # the first fetch reads them
    (None, 100.0 - LOOK_EVERY_S / 2, False),  # no lane in use, read lately: not again
    (None, 100.0 - LOOK_EVERY_S, True),  # read LOOK_EVERY_S ago: again
    (100.0 - 59.0, 100.0 - LOOK_EVERY_S / 2, True),  # a lane held tasks lately: every fetch
    (100.0 - 60.0, 100.0 - LOOK_EVERY_S / 2, False),  # not for `recent`: as if none
])
def test_reads_counts(seen: float | None, read: float | None, reads: bool) -> None:
    assert reads_counts(100.0, seen, read, recent=60.0) is reads


def test_lane_durables_are_apart_where_their_names_would_join() -> None:
    one = subjects.lane_durable("a-b", "default", "c")
    other = subjects.lane_durable("a", "default", "b-c")
    assert one != other and one.startswith("lane-default-a-b-c-")
    assert subjects.model_of_durable(one) is None  # not a class's shared durable
    assert subjects.lane("m", "*", "*") == "fleet.tasks.m.*.*"


async def test_a_pull_takes_the_shared_queue_then_the_least_served_lane(
    provisioned_nc: Client,
) -> None:
    """Against a real nats-server: in FLEET_FAIRNESS A stands at 3,000, B at 2,800 (weight
    2), C has no entry (idle: lifted to 512 behind the least of the others); the class's
    shared queue comes first, then the lanes by their counters; a lower class's lane waits
    for its class's turn."""
    js = provisioned_nc.jetstream()
    kv = await js.key_value(FAIRNESS)
    await kv.put("m.default.a", TenantShare(counter=3000, waiting=0, at=0).model_dump_json()
                 .encode())
    await kv.put("m.default.b", TenantShare(counter=2800, waiting=0, at=0, weight=2)
                 .model_dump_json().encode())
    puller = TaskPuller(provisioned_nc, js, Settings())
    try:
        for n in range(3):
            await js.publish(subjects.lane("m", "default", "a"), f"a-{n}".encode())
        await js.publish(subjects.lane("m", "default", "c"), b"c-0")  # no entry: counter 0
        await js.publish(subjects.lane("m", "batch", "b"), b"batch-b-0")
        await js.publish(subjects.lane("m", "default", "b"), b"b-0")
        await js.publish(subjects.tasks("m"), b"shared-0")
        got = await puller.fetch("m", 4)
        # c lifted to 2800 - 512 = 2288: ahead of b (2800) and a (3000), once; then b
        # (2800, +128 a pick at weight 2), then a
        assert [m.data for m in got] == [b"shared-0", b"c-0", b"b-0", b"a-0"]
        assert TenantShare.model_validate_json((await kv.get("m.default.c")).value or b"") \
            .counter == 2800 - CREDIT
        got += await puller.fetch("m", 3)
        assert [m.data for m in got[4:]] == [b"a-1", b"a-2", b"batch-b-0"]
        for msg in got:
            await msg.ack()
        assert set(puller.lanes.taken) == {"a", "b", "c"}
    finally:
        await puller.close()


async def test_a_worker_pulls_and_charges_lanes_under_the_shipped_roles(
    tmp_path: Path,
) -> None:
    """On ops/nats/auth.conf: a client publishes on its lane, a worker (its role alone)
    makes the lane's durable, reads the lanes' counts and counters, lifts one, pulls, acks
    and charges; no permission violation."""
    violations: list[str] = []
    with shipped_auth_server(tmp_path) as url:
        admin = await as_role(url, "operator")
        await provision(admin)
        await admin.close()
        publisher = await as_role(url, "client", violations)
        worker = await as_role(url, "worker", violations)
        try:
            js = worker.jetstream()
            kv = await js.key_value(FAIRNESS)
            await kv.put("m.default.a", TenantShare(counter=2000, waiting=0, at=0)
                         .model_dump_json().encode())
            for tenant in ("a", "b"):
                task = TextGeneration(task_id=f"sec-{tenant}", model="m", prompt="hi",
                                      tenant=tenant)
                await publisher.jetstream().publish(subjects.lane("m", "default", tenant),
                                                    encode(task))
            puller = TaskPuller(worker, js, Settings())
            try:
                got = await puller.fetch("m", 1)
                assert [m.subject for m in got] == [subjects.lane("m", "default", "b")]
                charges = FairCharges(js)
                done = TaskFinished(task_id="sec-b", at=0.0, status="completed",
                                    usage=Usage(prompt_tokens=1, completion_tokens=9))
                charge = await charges.before_ack(got[0], done)
                await got[0].ack_sync()
                await charges.after_ack(charge)
            finally:
                await puller.close()
            entry = TenantShare.model_validate_json((await kv.get("m.default.b")).value or b"")
            assert (entry.counter, entry.settled) == (2000 - CREDIT + 10, [])  # lifted, charged
            assert violations == []
        finally:
            await publisher.close()
            await worker.close()
