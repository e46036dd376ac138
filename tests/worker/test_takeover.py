"""Taking a task over and fencing the attempt that lost it (fleet.worker.takeover): the rules
as tables, then the fence against a real nats-server: two workers' outputs of one task, the
second taking it over while the first still writes."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.js.errors import APIError

from fleet.wire.events import TaskAccepted, TaskFence, TaskFinished, TokenChunk
from fleet.worker.continuation import stored_events
from fleet.worker.deathwatch import Probe
from fleet.worker.outputs import TaskOutput
from fleet.worker.takeover import (
    EXPECTED_LAST_SUBJECT_SEQ,
    EXPECTED_SUBJECT,
    FencedFate,
    RedeliveryFate,
    Superseded,
    TaskFenced,
    fence_headers,
    fence_subject,
    fenced_fate,
    holder_of,
    holder_to_ask,
    is_fenced,
    may_take_over,
    redelivery_fate,
    takes_fence,
)


@pytest.mark.parametrize(("delivery", "handed_in", "claimed_before", "takes"), [
    (1, False, False, False),  # a first delivery writes under fence 0: takeovers refuse that
    (2, False, False, True),  # its holder stopped beating (dead or paused) or gave it back
    (5, False, False, True),
    (1, True, False, True),  # handed on by a node whose runner may have streamed part of it
    # Its claim was this message's already: delivered before, whatever the count says (a
    # server restarted on its store forgot the delivery), or its create's answer was lost.
    (1, False, True, True),
    (2, False, True, True),
])
def test_who_takes_a_task_over(
    delivery: int, handed_in: bool, claimed_before: bool, takes: bool
) -> None:
    assert takes_fence(delivery, handed_in=handed_in, claimed_before=claimed_before) is takes


def fence(delivery: int, node: str = "b") -> TaskFence:
    return TaskFence(task_id="t1", attempt=1, node_id=node, delivery=delivery, at=1.0)


def accepted(node: str) -> TaskAccepted:
    return TaskAccepted(task_id="t1", at=1.0, model="m", node_id=node, runner_id="r1")


@pytest.mark.parametrize(("last", "first_accept", "holder"), [
    (None, None, None),  # never dispatched: nobody to ask
    (None, accepted("a"), "a"),  # its first attempt's node
    (fence(2, "c"), accepted("a"), "c"),  # taken over (or handed in) since: the last taker
    (fence(2, "c"), None, "c"),
])
def test_who_holds_a_task(
    last: TaskFence | None, first_accept: TaskAccepted | None, holder: str | None
) -> None:
    assert holder_of(last, first_accept) == holder


@pytest.mark.parametrize(("delivery", "holder", "handed_in", "claimed_before", "asked"), [
    (2, "a", False, False, "a"),  # a redelivery of a task node a took: ask a first
    (5, "a", False, False, "a"),
    (1, "a", False, False, None),  # a first delivery takes nothing over
    (2, "b", False, False, None),  # this node's own earlier attempt: it holds it no more
    (2, None, False, False, None),  # nobody known to hold it
    (2, "a", True, False, None),  # handed in: its sender gave it up to this node
    # A first delivery of a message that claimed the id before: node a took it earlier (a
    # server restarted on its store delivered it again as a first delivery): ask a first.
    (1, "a", False, True, "a"),
    (1, None, False, True, None),  # its own create's answer was lost: nobody holds it
    (1, "b", False, True, None),
    (1, "a", True, True, None),
])
def test_whom_a_redelivery_asks_first(
    delivery: int, holder: str | None, handed_in: bool, claimed_before: bool,
    asked: str | None,
) -> None:
    assert holder_to_ask(delivery, "b", holder, handed_in=handed_in,
                         claimed_before=claimed_before) == asked


@pytest.mark.parametrize(("probe", "fate"), [
    # Alive and beating: the redelivery is the consumer's (a leader change), not a loss;
    # the holder keeps the message renewed under the new delivery and nothing runs twice.
    (Probe.ANSWERED, RedeliveryFate.PASS_TO_HOLDER),
    (Probe.NO_RESPONDERS, RedeliveryFate.TAKE_OVER),  # dead: continue it here
    (Probe.SILENT, RedeliveryFate.TAKE_OVER),  # paused or cut off: the fence stops it later
])
def test_a_redelivery_is_passed_only_to_a_holder_that_answers(
    probe: Probe, fate: RedeliveryFate
) -> None:
    assert redelivery_fate(probe) is fate


@pytest.mark.parametrize(("delivery", "node", "last", "handed_in", "may"), [
    (2, "a", None, False, True),  # no takeover yet
    (3, "a", fence(2), False, True),  # newer than the last taker's
    # A paused worker's pending pull was handed delivery 2; delivery 3 took the task over
    # elsewhere meanwhile: when it resumes, its delivery takes nothing.
    (2, "a", fence(3), False, False),
    (3, "a", fence(3), False, False),  # the same delivery on another node: not ours
    (3, "b", fence(3), False, True),  # our own fence, written again (a retried publish)
    (3, "a", fence(3), True, True),  # node b handed its delivery to a: a takes it over
    (2, "a", fence(3), True, False),  # handed in, but an older delivery all the same
])
def test_only_a_newer_delivery_may_take_over(
    delivery: int, node: str, last: TaskFence | None, handed_in: bool, may: bool
) -> None:
    assert may_take_over(delivery, node, last, handed_in=handed_in) is may


@pytest.mark.parametrize(("in_flight", "pending", "fate"), [
    (True, False, FencedFate.CANCEL_RUNNER),  # still generating: stop it, drop its terminal
    (True, True, FencedFate.CANCEL_RUNNER),  # on a runner wins
    (False, True, FencedFate.RELEASE),  # queued here: drop it, no verb
    (False, False, FencedFate.IGNORE),  # ending or gone: its ending gives it up itself
])
def test_what_a_fenced_worker_does(in_flight: bool, pending: bool, fate: FencedFate) -> None:
    assert fenced_fate(in_flight=in_flight, pending=pending) is fate


@pytest.mark.parametrize(("fence", "expected"), [(0, "0"), (17, "17")])
def test_every_event_names_its_attempts_fence(fence: int, expected: str) -> None:
    assert fence_headers("t1", fence) == {
        EXPECTED_LAST_SUBJECT_SEQ: expected, EXPECTED_SUBJECT: "fleet.out.t1.fence"
    }
    assert fence_subject("t1").startswith("fleet.out.t1.")  # in FLEET_OUT, not on t1's subject


@pytest.mark.parametrize(("error", "fenced"), [
    (APIError(code=400, err_code=10071, description="wrong last sequence: 5"), True),
    (APIError(code=400, err_code=10054, description="maximum payload exceeded"), False),
    (APIError(code=503, description="no responders"), False),
    (TimeoutError(), False),
])
def test_only_a_wrong_last_sequence_is_a_fence(error: Exception, fenced: bool) -> None:
    assert is_fenced(error) is fenced


def accepted(task_id: str, node: str, attempt: int) -> TaskAccepted:
    return TaskAccepted(task_id=task_id, at=1.0, model="m", node_id=node, runner_id="r",
                        attempt=attempt, delivery=attempt + 1)


def token(task_id: str, index: int) -> TokenChunk:
    return TokenChunk(task_id=task_id, at=1.0, index=index, token_id=100 + index, text=f" t{index}")


def completed(task_id: str) -> TaskFinished:
    return TaskFinished(task_id=task_id, at=1.0, status="completed", finish_reason="length")


async def test_a_paused_attempts_late_writes_are_refused_once_another_took_over(
    provisioned_nc: Client,
) -> None:
    nc, task_id = provisioned_nc, "fenced-1"
    fenced: list[str] = []
    old = TaskOutput(nc, nc.jetstream(), budget_s=5.0, on_fenced=fenced.append)
    new = TaskOutput(nc, nc.jetstream(), budget_s=5.0)
    await old.chunk(accepted(task_id, "node-a", 0))
    for index in range(3):
        await old.chunk(token(task_id, index))
    assert await old.confirmed.settle(task_id) is None  # stored: the new attempt reads them
    # The takeover: fence first, then read back (nothing of the old attempt lands between).
    assert await new.take_over(task_id, "node-b", delivery=2) > 0
    generated = [e for e in await stored_events(nc, nc.jetstream(), task_id)
                 if isinstance(e, TokenChunk)]
    assert [e.index for e in generated] == [0, 1, 2]
    # The paused attempt resumes and writes on: refused, told once, and it gives up.
    await old.chunk(token(task_id, 3))
    await old.chunk(token(task_id, 4))
    with pytest.raises(TaskFenced):
        await old.finish(completed(task_id))
    assert fenced == [task_id]
    await new.chunk(accepted(task_id, "node-b", 1))
    for index in range(3, 6):
        await new.chunk(token(task_id, index))
    await new.finish(completed(task_id))
    events = await stored_events(nc, nc.jetstream(), task_id)
    assert [e.index for e in events if isinstance(e, TokenChunk)] == list(range(6))
    assert [e.node_id for e in events if isinstance(e, TaskAccepted)] == ["node-a", "node-b"]
    assert sum(isinstance(e, TaskFinished) for e in events) == 1
    assert isinstance(events[-1], TaskFinished)


async def test_two_takers_at_once_leave_one_fence_standing(provisioned_nc: Client) -> None:
    nc, task_id = provisioned_nc, "fenced-2"
    outputs = [TaskOutput(nc, nc.jetstream(), budget_s=5.0) for _ in range(2)]
    older, newer = await asyncio.gather(*(
        output.take_over(task_id, f"node-{i}", delivery=2 + i)
        for i, output in enumerate(outputs)
    ), return_exceptions=True)
    # Which write lands first is the scheduler's: the newer delivery's fence always stands;
    # the older one either fenced first and was replaced, or found the newer and gave up.
    assert isinstance(newer, int)
    if isinstance(older, BaseException):
        assert isinstance(older, Superseded)
    else:
        assert older != newer  # compare-and-set: one after the other, never the same
    winner, loser = outputs[1], outputs[0]
    await winner.chunk(token(task_id, 0))
    assert await winner.confirmed.settle(task_id) is None
    if isinstance(older, BaseException):
        return  # the older attempt holds no fence: it has nothing to write under
    await loser.chunk(token(task_id, 1))  # index 0 would be the winner's duplicate (Msg-Id)
    assert await loser.confirmed.settle(task_id) is not None
    assert loser.confirmed.fenced(task_id)
