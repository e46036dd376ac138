"""The ack policy: every row of the table, and the effectful part against a real nats-server."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.provision import ensure_task_consumer
from fleet.wire import subjects
from fleet.wire.tasks import TextGeneration
from fleet.worker.acks import (
    HAND_BACK_DELAY_S,
    AckPolicy,
    Kind,
    Stage,
    Verb,
    ack_stage,
    decide,
    held_stages,
    progress_every,
    tick_every,
)
from fleet.worker.continuation import CrashFate, crash_fate
from fleet.worker.state import PendingTask, RunnerView, TaskRecord, WorkerState

ACK_WAIT = 30.0
DUE = progress_every(ACK_WAIT)
NOTHING = Verb(Kind.NOTHING)
IN_PROGRESS = Verb(Kind.IN_PROGRESS)

TABLE = [
    # stage, seconds since the last verb, the verb
    (Stage.RECEIVING, 0.0, NOTHING),
    (Stage.RECEIVING, DUE, IN_PROGRESS),  # an intake waiting out an election stays ours
    (Stage.WAITING_INPUTS, 0.0, NOTHING),
    (Stage.WAITING_INPUTS, DUE, IN_PROGRESS),
    (Stage.WAITING_SLOT, DUE - 0.1, NOTHING),
    (Stage.WAITING_SLOT, DUE, IN_PROGRESS),
    (Stage.WAITING_SLOT, 10 * ACK_WAIT, IN_PROGRESS),
    (Stage.RUNNING, 1.0, NOTHING),
    (Stage.RUNNING, DUE + 1, IN_PROGRESS),
    (Stage.STOPPING_RUNNING, 0.0, NOTHING),
    (Stage.STOPPING_RUNNING, DUE, IN_PROGRESS),
    (Stage.FINISHED_STORED, 0.0, Verb(Kind.ACK, confirm=True)),
    (Stage.FINISHED_STORED, 99.0, Verb(Kind.ACK, confirm=True)),
    (Stage.REDELIVERED_FINISHED, 0.0, Verb(Kind.ACK, confirm=True)),
    (Stage.FINISHED_NOT_STORED, 0.0, NOTHING),
    (Stage.FINISHED_NOT_STORED, 99.0, NOTHING),
    (Stage.INVALID, 0.0, Verb(Kind.TERM)),
    (Stage.STOPPING_NOT_STARTED, 0.0, Verb(Kind.NAK)),
    (Stage.STOPPED_MID_RUN, 0.0, Verb(Kind.NAK)),
    (Stage.HANDED_BACK, 0.0, Verb(Kind.NAK, delay_s=HAND_BACK_DELAY_S)),
    # A stale delivery of a task taken over since: the message is the newer holder's.
    (Stage.SUPERSEDED, 0.0, NOTHING),
]


@pytest.mark.parametrize(("stage", "since", "verb"), TABLE)
def test_the_ack_table(stage: Stage, since: float, verb: Verb) -> None:
    assert decide(stage, since, ACK_WAIT) == verb


def test_the_table_covers_every_stage() -> None:
    assert {row[0] for row in TABLE} == set(Stage)


@pytest.mark.parametrize("ack_wait", [1.0, 2.0, 30.0, 300.0])
def test_a_held_message_is_told_well_inside_ack_wait(ack_wait: float) -> None:
    # The longest silence: due after progress_every, noticed at most one tick later.
    assert progress_every(ack_wait) + tick_every(ack_wait) <= 0.5 * ack_wait


async def test_settle_and_heartbeat_against_a_real_server(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    await ensure_task_consumer(provisioned_nc, "m", ack_wait_s=2.0)
    sub = await js.pull_subscribe_bind(subjects.durable("m"), stream=subjects.TASKS_STREAM)
    for n in range(3):
        await js.publish(subjects.tasks("m"), f"task {n}".encode())
    msgs: list = []
    while len(msgs) < 3:  # a fetch may return fewer than asked for
        msgs += await sub.fetch(3 - len(msgs), timeout=5)
    a, b, c = msgs
    policy = AckPolicy(ack_wait_s=2.0, budget_s=2.0)
    policy.hold("a", a, now=0.0)
    await policy.heartbeat({"a": Stage.WAITING_SLOT}, now=progress_every(2.0))
    assert policy.sent[Kind.IN_PROGRESS] == 1
    assert await policy.settle("a", a, Stage.FINISHED_STORED)
    assert await policy.settle("b", b, Stage.INVALID)
    assert await policy.settle("b", b, Stage.INVALID)  # a second verb is not a failure
    assert await policy.settle("c", c, Stage.FINISHED_NOT_STORED)
    assert policy.held() == []
    assert policy.sent == {Kind.IN_PROGRESS: 1, Kind.ACK: 1, Kind.TERM: 1}
    assert sum(policy.failures.values()) == 0
    # term is a core publish the server applies in its own time (seen under load: still 2
    # pending right after a flush): c alone stays pending, not acked, to be redelivered.
    async with asyncio.timeout(10):
        while (await js.consumer_info(subjects.TASKS_STREAM, subjects.durable("m"))
               ).num_ack_pending != 1:
            await provisioned_nc.flush()


async def test_a_verb_that_cannot_be_sent_is_counted_not_swallowed(
    provisioned_nc: Client,
) -> None:
    js = provisioned_nc.jetstream()
    await ensure_task_consumer(provisioned_nc, "m")
    sub = await js.pull_subscribe_bind(subjects.durable("m"), stream=subjects.TASKS_STREAM)
    await js.publish(subjects.tasks("m"), b"x")
    [msg] = await sub.fetch(1, timeout=2)
    await provisioned_nc.close()
    policy = AckPolicy(ack_wait_s=30.0, budget_s=0.5)
    policy.hold("x", msg, now=0.0)
    await policy.heartbeat({"x": Stage.RUNNING}, now=100.0)
    assert not await policy.settle("x", msg, Stage.FINISHED_STORED)
    assert policy.failures == {Kind.IN_PROGRESS: 1, Kind.ACK: 1}


async def test_a_redelivery_of_a_held_message_is_recognised_and_renewed(
    provisioned_nc: Client,
) -> None:
    """AckWait ran out while the message was held (its in_progress lost in an election):
    the redelivery is the same task, still ours, not new work."""
    js = provisioned_nc.jetstream()
    await ensure_task_consumer(provisioned_nc, "m", ack_wait_s=1.0)
    sub = await js.pull_subscribe_bind(subjects.durable("m"), stream=subjects.TASKS_STREAM)
    await js.publish(subjects.tasks("m"), b"held")
    await js.publish(subjects.tasks("m"), b"other")
    [first] = await sub.fetch(1, timeout=5)
    policy = AckPolicy(ack_wait_s=1.0, budget_s=2.0)
    policy.hold("t", first, now=0.0)
    [other] = await sub.fetch(1, timeout=5)
    assert policy.redelivered_while_held(other) is None  # a first delivery of another message
    [again] = await sub.fetch(1, timeout=5)  # after AckWait (1 s): the same message again
    assert again.metadata.num_delivered == 2 and again.data == b"held"
    assert policy.redelivered_while_held(again) == "t"
    policy.renew("t", again, now=10.0)
    await policy.beat_now("t", now=10.0)
    assert policy.sent[Kind.IN_PROGRESS] == 1
    assert await policy.settle("t", again, Stage.FINISHED_STORED)
    await other.ack()
    await provisioned_nc.flush()
    info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable("m"))
    assert info.num_ack_pending == 0


async def test_a_held_message_delivered_again_as_a_first_delivery_is_still_recognised(
    provisioned_nc: Client,
) -> None:
    """A server killed and restarted on its store may have lost its consumer's last
    deliveries and send a held message again with a delivery count of 1: still ours."""
    js = provisioned_nc.jetstream()
    await ensure_task_consumer(provisioned_nc, "m", ack_wait_s=30.0)
    sub = await js.pull_subscribe_bind(subjects.durable("m"), stream=subjects.TASKS_STREAM)
    await js.publish(subjects.tasks("m"), b"held")
    [first] = await sub.fetch(1, timeout=5)
    policy = AckPolicy(ack_wait_s=30.0, budget_s=2.0)
    policy.hold("t", first, now=0.0)
    # The restarted server's delivery of the same stream message: count 1, a new consumer seq.
    tokens = first.reply.split(".")
    tokens[6] = str(int(tokens[6]) + 1)  # $JS.ACK.<stream>.<consumer>.<count>.<sseq>.<cseq>...
    again = Msg(_client=provisioned_nc, subject=first.subject, reply=".".join(tokens),
                data=first.data)
    assert again.metadata.num_delivered == 1
    assert again.metadata.sequence.stream == first.metadata.sequence.stream
    assert policy.redelivered_while_held(again) == "t"


def test_held_stages_say_where_each_held_message_stands() -> None:
    text = TextGeneration(task_id="w", model="m", prompt="hi")
    state = WorkerState(
        node_id="n", receiving={"intake-3": "m"},
        pending={"w": PendingTask(text, 0.0, inputs={}),
                 "i": PendingTask(text.model_copy(update={"task_id": "i"}), 0.0)},
    )
    held = ["intake-3", "w", "i", "r"]
    assert held_stages(state, held) == {
        "intake-3": Stage.RECEIVING, "w": Stage.WAITING_SLOT, "i": Stage.WAITING_INPUTS,
        "r": Stage.RUNNING,
    }
    stopping = replace(state, stopping=True, pending={})
    assert held_stages(stopping, ["r"]) == {"r": Stage.STOPPING_RUNNING}


@pytest.mark.parametrize(
    ("record", "stopping", "stage", "fate"),
    [
        (TaskRecord(), False, Stage.RUNNING, CrashFate.READ_BACK),
        (TaskRecord(ending=True), False, Stage.RUNNING, CrashFate.ENDING),
        (TaskRecord(ending=True), True, Stage.STOPPING_RUNNING, CrashFate.ENDING),
    ],
)
def test_a_task_ending_behind_an_upload_is_held_and_never_restarted(
    record: TaskRecord, stopping: bool, stage: Stage, fate: CrashFate
) -> None:
    """The record says what its held message gets (in_progress: its terminal is not stored)
    and what its runner's exit does to it (nothing: it ends once, after its images)."""
    runner = RunnerView("r-1", "i-1", "m", in_flight=frozenset({"t"}))
    state = WorkerState(node_id="n", runners={"r-1": runner}, tasks={"t": record},
                        stopping=stopping)
    assert ack_stage(state, "t") is stage
    assert decide(stage, progress_every(2.0), 2.0).kind is Kind.IN_PROGRESS
    ending = state.task("t").ending
    assert crash_fate(terminal_waiting=ending, held_for_continuation=True) is fate


def test_a_task_offered_to_another_node_is_still_held_waiting_for_a_slot() -> None:
    text = TextGeneration(task_id="o", model="m", prompt="hi")
    offered = PendingTask(text, 0.0, inputs={}, handing_off="node-b")
    assert ack_stage(WorkerState(node_id="n", pending={"o": offered}), "o") is Stage.WAITING_SLOT


async def test_a_confirmed_ack_goes_pipelined_and_a_second_verb_is_known_too_late(
    provisioned_nc: Client,
) -> None:
    """A finished task's ack is one pipelined publish, confirmed by the server (its answer to
    the ack's reply subject), and the message is marked acked as ack_sync marks it."""
    js = provisioned_nc.jetstream()
    await ensure_task_consumer(provisioned_nc, "m", ack_wait_s=30.0)
    sub = await js.pull_subscribe_bind(subjects.durable("m"), stream=subjects.TASKS_STREAM)
    for n in range(20):
        await js.publish(subjects.tasks("m"), f"task {n}".encode())
    msgs: list[Msg] = []
    while len(msgs) < 20:  # a fetch may return fewer than asked for
        msgs += await sub.fetch(20 - len(msgs), timeout=5)
    policy = AckPolicy(ack_wait_s=30.0, budget_s=2.0)
    for n, msg in enumerate(msgs):
        policy.hold(str(n), msg, now=0.0)
    assert all(await asyncio.gather(*(policy.settle(str(n), msg, Stage.FINISHED_STORED)
                                      for n, msg in enumerate(msgs))))
    assert policy.sent == {Kind.ACK: 20} and not policy.failures and policy.held() == []
    assert all(msg._ackd for msg in msgs)
    info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable("m"))
    assert info.num_ack_pending == 0  # confirmed: the server had them all before the answers
    assert await policy.settle("0", msgs[0], Stage.FINISHED_STORED)  # already acked: no fault
    assert not policy.failures
