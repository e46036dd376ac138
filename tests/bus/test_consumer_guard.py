"""A model's durable keeps Fleet's configuration (issue 31, item 5): a compromised worker that
updates `tasks-<model>` with another filter is undone by the others; one that cannot be
undone stops the pulls with an error naming it. Real server, shipped roles."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from fleet.bus.connect import js_publish
from fleet.bus.provision import consumer_definition, ensure_task_consumer, provision
from fleet.wire import subjects
from fleet.worker.consumer_guard import (
    SETTINGS,
    ConsumerGuard,
    consumer_drift,
    passed_over_at,
    skipped_tasks,
)
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    events_of,
    finished,
    hello,
    run_task,
    serving,
)
from tests.secured import as_role, shipped_auth_server

MODEL = "guarded"
SECOND = 1_000_000_000
WANTED = consumer_definition(MODEL, 5, 30.0)


@pytest.mark.parametrize(("change", "drifted"), [
    ({}, []),
    ({"filter_subject": "fleet.tasks.elsewhere"}, ["filter_subject"]),
    ({"max_waiting": 1, "max_ack_pending": 1}, ["max_ack_pending", "max_waiting"]),
    ({"ack_wait": 1_000_000}, ["ack_wait"]),
    ({"max_deliver": 1}, ["max_deliver"]),
    ({"ack_policy": "none", "deliver_policy": "new"}, ["deliver_policy", "ack_policy"]),
    ({"inactive_threshold": 5 * SECOND}, ["inactive_threshold"]),
    ({"filter_subject": "", "filter_subjects": ["fleet.tasks.a", "fleet.tasks.b"]},
     ["filter_subject", "filter_subjects"]),
    ({"description": "reworded", "num_replicas": 3}, []),  # not what decides delivery
    ({"inactive_threshold": 0, "filter_subjects": None}, []),  # the server's "none"
])
def test_consumer_drift(change: dict[str, Any], drifted: list[str]) -> None:
    lines = consumer_drift(WANTED, {**WANTED, **change})
    assert [line.split(":")[0] for line in lines] == drifted


@pytest.mark.parametrize(("stored", "pending", "ack_pending", "skipped"), [
    (0, 0, 0, 0), (3, 3, 0, 0), (3, 1, 2, 0), (3, 0, 1, 2), (1, 0, 0, 1), (2, 5, 0, 0),
])
def test_skipped_tasks(stored: int, pending: int, ack_pending: int, skipped: int) -> None:
    assert skipped_tasks(stored, pending, ack_pending) == skipped


@pytest.mark.parametrize(("delivered", "pending", "seq", "passed"), [
    (1, 0, 2, True),  # after the last delivery, nothing owed: passed over
    (1, 1, 2, False),  # owed: it will come
    (2, 0, 2, False),  # delivered meanwhile (a healthy consumer raced the look-up)
    (5, 0, 2, False),  # below the last delivery: held somewhere, or past MaxDeliver
])
def test_passed_over_at(delivered: int, pending: int, seq: int, passed: bool) -> None:
    info = {"delivered": {"stream_seq": delivered}, "num_pending": pending}
    assert passed_over_at(info, seq) is passed


def test_a_binding_worker_leaves_its_settings_to_the_conflict_check() -> None:
    changed = {**WANTED, "max_deliver": 2, "filter_subject": "x"}
    assert [d.split(":")[0] for d in consumer_drift(WANTED, changed, SETTINGS)] == [
        "filter_subject"]


class StoppedPulls:
    def __init__(self) -> None:
        self.subs: dict[str, object] = {MODEL: object()}
        self.class_subs: dict[tuple[str, str], object] = {}
        self.stopped: dict[str, str] = {}

    async def stop_pulling(self, model: str, reason: str) -> None:
        self.stopped[model] = reason
        self.subs.pop(model, None)


@pytest.fixture(scope="module")
def secured_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shipped_auth_server(tmp_path_factory.mktemp("guard")) as url:
        asyncio.run(_provision(url))
        yield url


async def _provision(url: str) -> None:
    admin = await as_role(url, "operator")
    try:
        await provision(admin)
    finally:
        await admin.close()


@pytest.fixture
async def workers(secured_url: str) -> AsyncIterator[tuple[Client, Client]]:
    honest, rogue = await as_role(secured_url, "worker"), await as_role(secured_url, "worker")
    yield honest, rogue
    await honest.close()
    await rogue.close()


async def _update(nc: Client, name: str, config: dict[str, Any]) -> dict[str, Any]:
    body = {"stream_name": "FLEET_TASKS", "config": config}
    reply = await nc.request(f"$JS.API.CONSUMER.CREATE.FLEET_TASKS.{name}",
                             json.dumps(body).encode(), timeout=5)
    return json.loads(reply.data)


async def _config(nc: Client, name: str) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.CONSUMER.INFO.FLEET_TASKS.{name}", b"", timeout=5)
    return json.loads(reply.data)["config"]


async def test_a_changed_filter_is_restored_and_tasks_flow_again(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    honest, rogue = workers
    await ensure_task_consumer(honest, MODEL)
    halted = await _update(rogue, f"tasks-{MODEL}", {
        **WANTED, "filter_subject": "fleet.tasks.nothing-here", "max_ack_pending": 1})
    assert "error" not in halted  # the attack of issue 31 goes through the worker grant

    sub = await honest.jetstream().pull_subscribe_bind(f"tasks-{MODEL}", stream="FLEET_TASKS")
    with pytest.raises(TimeoutError):  # halted: the task is passed over
        await honest.jetstream().publish(f"fleet.tasks.{MODEL}", b"while changed")
        await sub.fetch(1, timeout=1)

    guard = ConsumerGuard(honest, StoppedPulls(), 5, 30.0)
    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        assert await guard.check(MODEL) == "restored"
    assert "filter_subject: 'fleet.tasks.nothing-here'" in caplog.text
    assert "passed over tasks" in caplog.text and "they are delivered" in caplog.text

    assert consumer_drift(WANTED, await _config(honest, f"tasks-{MODEL}")) == []
    [msg] = await sub.fetch(1, timeout=5)  # the passed-over task is delivered after all
    assert msg.data == b"while changed"
    await msg.term()
    assert await guard.check(MODEL) == "ok"


async def test_a_filter_changed_and_restored_between_two_checks_leaves_no_task_behind(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    """The rogue puts the filter back itself before any check sees it: the configuration is
    right, but the task published meanwhile was passed over. The next round delivers it."""
    honest, rogue = workers
    model = "flipped"
    await ensure_task_consumer(honest, model)
    wanted = consumer_definition(model, 5, 30.0)
    sub = await honest.jetstream().pull_subscribe_bind(f"tasks-{model}", stream="FLEET_TASKS")
    await _update(rogue, f"tasks-{model}", {**wanted, "filter_subject": "fleet.tasks.nowhere"})
    with pytest.raises(TimeoutError):  # workers pull all the time: the position moves on
        await honest.jetstream().publish(f"fleet.tasks.{model}", b"published meanwhile")
        await sub.fetch(1, timeout=1)
    await _update(rogue, f"tasks-{model}", wanted)
    with pytest.raises(TimeoutError):
        await sub.fetch(1, timeout=1)  # passed over

    pulls = StoppedPulls()
    pulls.subs = {model: sub}
    guard = ConsumerGuard(honest, pulls, 5, 30.0)
    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        await guard.round(model)
    assert "passed over tasks" in caplog.text
    [msg] = await sub.fetch(1, timeout=5)
    assert msg.data == b"published meanwhile"
    await msg.term()


async def test_tasks_left_behind_a_moved_position_are_reported_when_they_stay(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    """A rogue reset moves the position past a queued task (below the last delivery now):
    it cannot be told from a task past MaxDeliver yet, so it is reported once it stays."""
    honest, rogue = workers
    model = "moved"
    await ensure_task_consumer(honest, model)
    js = honest.jetstream()
    await js.publish(f"fleet.tasks.{model}", b"left behind")
    last = await js.publish("fleet.tasks.another-model", b"later in the stream")
    reply = await rogue.request(f"$JS.API.CONSUMER.RESET.FLEET_TASKS.tasks-{model}",
                                json.dumps({"seq": last.seq + 1}).encode(), timeout=5)
    assert "error" not in json.loads(reply.data)
    guard = ConsumerGuard(honest, StoppedPulls(), 5, 30.0)
    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        await guard.round(model)
        assert "will not be delivered" not in caplog.text  # once could be MaxDeliver's
        await guard.round(model)
    assert f"1 task(s) of {model} stay in FLEET_TASKS and will not be delivered" in caplog.text


async def test_a_durable_that_cannot_be_restored_stops_the_pulls_with_the_reason(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    """Made by a rogue worker before the model was placed, with a pull-request limit
    (max_waiting 1) the server never lets an update change: nothing to restore, so nobody
    pulls from it."""
    honest, rogue = workers
    name = "tasks-pre-made"
    made = await _update(rogue, name, {
        **consumer_definition("pre-made", 5, 30.0), "max_waiting": 1})
    assert "error" not in made, made
    pulls = StoppedPulls()
    pulls.subs = {"pre-made": object()}
    guard = ConsumerGuard(honest, pulls, 5, 30.0)
    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        assert await guard.check("pre-made") == "stopped"
    assert "stops pulling pre-made" in caplog.text and "max_waiting" in caplog.text
    assert "pre-made" in pulls.stopped and "pre-made" not in pulls.subs


async def test_a_running_worker_restores_its_durable_and_tasks_flow(
    nats_url: str, tmp_path: Path
) -> None:
    """The guard as wired into `fleet worker`: a durable changed under a serving worker is
    restored by it within its check interval, so the next task completes."""
    data = tmp_path / "w"
    card = add_fault_card(data)
    worker = WorkerProcess(nats_url, data).start()
    nc, _ = await serving(nats_url, worker, card, slots=1)
    try:
        first = await run_task(nc, hello("before").model_copy(update={"model": card.id}))
        assert finished(first).status == "completed"  # the worker has bound tasks-<model>
        name = f"tasks-{card.id}"
        wanted = await _config(nc, name)
        changed = await _update(nc, name, {**wanted, "filter_subject": "fleet.tasks.nowhere"})
        assert changed["config"]["filter_subject"] == "fleet.tasks.nowhere"
        after = await run_task(nc, hello("after").model_copy(update={"model": card.id}),
                               timeout=60)
        assert finished(after).status == "completed"
        assert (await _config(nc, name))["filter_subject"] == f"fleet.tasks.{card.id}"
        assert "cannot be restored" not in (data / "worker.log").read_text()
        assert f"consumer {name} was changed" in (data / "worker.log").read_text()
    finally:
        worker.kill()
        await nc.close()


async def test_checks_beside_a_busy_healthy_durable_change_nothing(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    """Tasks published and pulled while the guard checks over and over: no reset, every task
    delivered exactly once (a reset racing a delivery would deliver it again)."""
    honest, _ = workers
    model = "busy"
    await ensure_task_consumer(honest, model)
    js = honest.jetstream()
    sub = await js.pull_subscribe_bind(f"tasks-{model}", stream="FLEET_TASKS")
    guard = ConsumerGuard(honest, StoppedPulls(), 5, 30.0)
    seen: list[tuple[bytes, int]] = []

    async def pull() -> None:
        while len(seen) < 200:
            try:
                for msg in await sub.fetch(8, timeout=1):
                    seen.append((msg.data, msg.metadata.num_delivered))
                    await msg.ack()
            except TimeoutError:
                continue

    async def publish() -> None:
        for i in range(200):
            await js.publish(f"fleet.tasks.{model}", str(i).encode())

    async def check() -> None:
        while len(seen) < 200:
            await guard.round(model)

    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        async with asyncio.timeout(60):
            await asyncio.gather(pull(), publish(), check())
    assert sorted(int(data) for data, _ in seen) == list(range(200))
    assert {delivered for _, delivered in seen} == {1}
    assert "passed over" not in caplog.text and "will not be delivered" not in caplog.text


async def test_a_changed_class_durable_is_restored_and_its_tasks_flow_again(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    """The interactive class's durable gets the same guard as the default one: a bound
    `interactive-tasks-<model>` pointed elsewhere is restored by the round, and the task
    published meanwhile is delivered."""
    honest, rogue = workers
    model = "classy"
    await ensure_task_consumer(honest, model)
    await ensure_task_consumer(honest, model, priority="interactive")
    name = f"interactive-tasks-{model}"
    wanted = consumer_definition(model, 5, 30.0, "interactive")
    assert wanted["filter_subject"] == f"fleet.tasks.{model}.interactive"
    sub = await honest.jetstream().pull_subscribe_bind(name, stream="FLEET_TASKS")
    await _update(rogue, name, {**wanted, "filter_subject": "fleet.tasks.nowhere"})
    await honest.jetstream().publish(f"fleet.tasks.{model}.interactive", b"chat")
    with pytest.raises(TimeoutError):
        await sub.fetch(1, timeout=1)  # passed over while changed

    pulls = StoppedPulls()
    pulls.subs = {model: object()}
    pulls.class_subs = {(model, "interactive"): sub}
    guard = ConsumerGuard(honest, pulls, 5, 30.0)
    assert guard.bound(model) == ["default", "interactive"]
    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        await guard.round(model)
    assert f"consumer {name} was changed" in caplog.text
    assert consumer_drift(wanted, await _config(honest, name)) == []
    [msg] = await sub.fetch(1, timeout=5)
    assert msg.data == b"chat"
    await msg.term()
    assert await guard.check(model, "interactive") == "ok"


async def test_a_class_durable_that_cannot_be_restored_stops_the_model(
    workers: tuple[Client, Client], caplog: pytest.LogCaptureFixture
) -> None:
    honest, rogue = workers
    model = "pre-made-batch"
    made = await _update(rogue, f"batch-tasks-{model}", {
        **consumer_definition(model, 5, 30.0, "batch"), "max_waiting": 1})
    assert "error" not in made, made
    pulls = StoppedPulls()
    pulls.subs = {model: object()}
    guard = ConsumerGuard(honest, pulls, 5, 30.0)
    with caplog.at_level(logging.ERROR, logger="fleet.worker.consumer_guard"):
        assert await guard.check(model, "batch") == "stopped"
    assert f"stops pulling {model}" in caplog.text and "max_waiting" in caplog.text
    assert model in pulls.stopped


def _classed(card_id: str, task_id: str, priority: str) -> Any:
    return hello(task_id).model_copy(update={"model": card_id, "priority": priority})


async def _run_classed(nc: Client, task: Any) -> list[Any]:
    collector = asyncio.create_task(events_of(nc, task.task_id, 60))
    await js_publish(nc.jetstream(), subjects.tasks(task.model, task.priority), task,
                     msg_id=task.task_id)
    return await collector


async def test_a_running_worker_recreates_and_restores_its_class_durables(
    nats_url: str, tmp_path: Path
) -> None:
    """Issue 25: a class durable deleted under a serving worker is made again (logged) and
    the class's tasks are served; one changed is restored within the guard's interval."""
    data = tmp_path / "w"
    card = add_fault_card(data)
    worker = WorkerProcess(nats_url, data).start()
    nc, _ = await serving(nats_url, worker, card, slots=1)
    try:
        for priority in ("interactive", "batch"):  # the worker binds both class durables
            done = await _run_classed(nc, _classed(card.id, f"first-{priority}", priority))
            assert finished(done).status == "completed"
        js = nc.jetstream()
        interactive = f"interactive-tasks-{card.id}"
        assert await js.delete_consumer("FLEET_TASKS", interactive)
        after = await _run_classed(nc, _classed(card.id, "after-delete", "interactive"))
        assert finished(after).status == "completed"
        assert f"consumer {interactive} is gone (deleted under this worker): recreating it" \
            in (data / "worker.log").read_text()

        batch = f"batch-tasks-{card.id}"
        wanted = await _config(nc, batch)
        await _update(nc, batch, {**wanted, "filter_subject": "fleet.tasks.nowhere"})
        later = await _run_classed(nc, _classed(card.id, "after-change", "batch"))
        assert finished(later).status == "completed"
        assert (await _config(nc, batch))["filter_subject"] == f"fleet.tasks.{card.id}.batch"
        assert f"consumer {batch} was changed" in (data / "worker.log").read_text()
    finally:
        worker.kill()
        await nc.close()
