"""A worker paused (SIGSTOP) past AckWait while it streams: another worker takes the task over
and continues it; when the paused one resumes, the stream refuses its late writes (its fence
is old, fleet.worker.takeover) and it gives the task up without a terminal or a verb. The
stored stream has no gap, no duplicate and one terminal.

Real processes: nats-server and two `fleet worker`s serving the fault engine (a plumbing
double: " t0 t1 ..." at a fixed pace). Only the worker process is stopped, not its runner:
the runner streams on into the pipe, so the resumed worker has a backlog of stale events to
write at once, the hardest case for the fence.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

from nats.aio.client import Client

from fleet.bus.provision import ensure_task_consumer
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import decode_model
from fleet.wire.events import TaskAccepted, TaskFinished, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import ENV, Live, finished_of, first_after, place_on
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    client,
    events_of,
    submit,
    wait_node,
)

TOKENS = 60
LONG_TOKENS = 600  # 60 s: it still streams when b's runner is ready
DEATH_WATCH_ENV = {"FLEET_ACK_WAIT_S": "300", "OPENBLAS_NUM_THREADS": "1"}


async def test_a_paused_worker_resumed_after_a_takeover_writes_nothing_more(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    nodes: dict[str, WorkerProcess] = {}
    for name in ("a", "b"):
        worker = start_worker(name, **ENV)
        card = add_fault_card(worker.data_dir)
        node = await wait_node(nc, worker.data_dir)
        await place_on(nc, card, node)
        nodes[node] = worker
    live = Live()
    await nc.subscribe("fleet.out.*", cb=live.on_msg)  # events; fences are one token below
    task = TextGeneration(
        task_id="paused", model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content=f"tokens:{TOKENS} delay_ms:60")],
    )
    await submit(nc, task)
    await live.until(lambda: live.tokens(task.task_id) >= 8, 60)
    paused_node = live.node_running(task.task_id)
    assert paused_node is not None
    paused = nodes[paused_node]
    assert paused.process is not None
    stopped_at = time.monotonic()
    os.kill(paused.process.pid, signal.SIGSTOP)  # the worker only: its runner streams on
    try:
        resumed = await live.until(lambda: first_after(live, task.task_id), 60)
    finally:
        os.kill(paused.process.pid, signal.SIGCONT)
    print(f"\npause seam (SIGSTOP -> next token from the other worker): "
          f"{resumed - stopped_at:.2f} s (AckWait 2 s)")
    events = await events_of(nc, task.task_id)
    indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
    assert indexes == list(range(TOKENS)), "a gap or a duplicate in the stored stream"
    text = "".join(e.text for e in events if isinstance(e, TokenChunk))
    assert text == "".join(f" t{i}" for i in range(TOKENS))
    assert finished_of(events).status == "completed"
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1]
    assert accepted[1].node_id != paused_node and accepted[1].moved_from == paused_node
    assert accepted[1].continued_from >= 8
    # The resumed worker gave the task up (its log says so) and is still serving.
    deadline = time.monotonic() + 30
    while "was taken over by another attempt" not in paused.log() and (
        "given up without a terminal" not in paused.log()
    ):
        assert time.monotonic() < deadline, paused.log()[-3000:]
        await asyncio.sleep(0.2)  # polling a log file: there is no event to wait on
    assert paused.process.poll() is None
    await nc.close()


@dataclass
class HeldByA:
    nc: Client
    holder: WorkerProcess
    other: WorkerProcess
    holder_node: str
    other_node: str
    live: Live
    task: TextGeneration


async def held_by_a(nats_url: str, start_worker: WorkerFactory, task_id: str) -> HeldByA:
    """Two workers with AckWait 300 s (nothing but the test delivers a task again); a long
    task streaming on a's one slot (so a pulls no more); then a runner on b too."""
    nc = await client(nats_url)
    holder, other = start_worker("a", **DEATH_WATCH_ENV), start_worker("b", **DEATH_WATCH_ENV)
    card, _ = add_fault_card(holder.data_dir), add_fault_card(other.data_dir)
    holder_node = await wait_node(nc, holder.data_dir)
    other_node = await wait_node(nc, other.data_dir)
    await place_on(nc, card, holder_node, slots=1)
    live = Live()
    await nc.subscribe("fleet.out.*", cb=live.on_msg)  # core: sees deduped publishes too
    task = TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content=f"tokens:{LONG_TOKENS} delay_ms:100")],
    )
    await submit(nc, task)
    await live.until(lambda: live.tokens(task.task_id) >= 3, 60)
    # Only now a runner on b (its start takes seconds): the task can only have gone to a.
    await place_on(nc, card, other_node)
    return HeldByA(nc, holder, other, holder_node, other_node, live, task)


async def test_a_redelivery_of_a_task_whose_holder_lives_is_passed_back_to_it(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    """Issue 27: a consumer's leader change can redeliver a message its holder took seconds
    before and still beats. Here a nak of the holder's delivery (sent by the test on the ack
    subject its heartbeat lists) stands in for that race: the other worker gets delivery 2
    while the holder streams on, finds the holder alive and passes the delivery back to it.
    One attempt, no fence, whole answer, and the holder keeps the message renewed."""
    held = await held_by_a(nats_url, start_worker, "redelivered")
    nc, holder, other, live, task = held.nc, held.holder, held.other, held.live, held.task
    holder_node = held.holder_node
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    entry = await kv.get(holder_node)
    acks = decode_model(NodeInfo, entry.value or b"").held_acks
    assert len(acks) == 1, acks
    await nc.publish(acks[0], b"-NAK")
    deadline = time.monotonic() + 60
    while "passed to it, not run twice" not in other.log():
        assert time.monotonic() < deadline, other.log()[-3000:]
        await asyncio.sleep(0.2)  # polling a log file: there is no event to wait on
    await live.until(lambda: finished_of_live(live, task.task_id), 120)
    await assert_run_once_by(nc, task.task_id, holder_node)
    assert "redelivered while it is held here: kept, not run twice" in holder.log()
    await nc.close()


async def assert_run_once_by(nc: Client, task_id: str, holder_node: str) -> None:
    """The stored stream is whole, completed, and accepted once: by its holder, attempt 0."""
    stored = await events_of(nc, task_id)
    indexes = token_indexes([e for e in stored if isinstance(e, TokenChunk)])
    assert indexes == list(range(LONG_TOKENS)), "a gap or a duplicate in the stored stream"
    assert finished_of(stored).status == "completed"
    accepted = [e for e in stored if isinstance(e, TaskAccepted)]
    assert [(e.attempt, e.node_id) for e in accepted] == [(0, holder_node)]


def finished_of_live(live: Live, task_id: str) -> bool:
    return any(isinstance(e, TaskFinished) for _, e in live.events.get(task_id, []))


async def test_a_held_task_delivered_again_as_a_first_delivery_runs_once(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    """A nats-server killed and restarted on its store forgets its consumers' last deliveries
    (their state is written behind the messages) and delivers a held message again with a
    delivery count of 1: in CI (the full-rate restart fault test) another worker then ran the
    task a second time under the same Msg-Ids, and the token events it batched otherwise were
    stored twice. Deleting and recreating the durable here stands in for that restart: the
    other worker gets the held message as a first delivery, finds that the message claimed
    the id before (fleet.worker.claims, OWN) and passes it to the holder, which lives. One
    attempt, nothing published by the other worker, whole answer."""
    held = await held_by_a(nats_url, start_worker, "forgotten")
    nc, holder, other, live, task = held.nc, held.holder, held.other, held.live, held.task
    holder_node, other_node = held.holder_node, held.other_node
    js = nc.jetstream()
    durable = subjects.durable("fault-llm")
    await js.delete_consumer(subjects.TASKS_STREAM, durable)
    await ensure_task_consumer(nc, "fault-llm", ack_wait_s=300.0)

    def accepted_by(node: str) -> bool:
        return any(isinstance(e, TaskAccepted) and e.node_id == node
                   for _, e in live.events.get(task.task_id, []))

    # Either way within seconds: passed back, or (the bug) accepted and run on b as well.
    await live.until(lambda: "passed to it, not run twice" in other.log()
                     or accepted_by(other_node), 60)
    assert not accepted_by(other_node), "b ran the task a second time"
    assert "handled as a redelivery" in other.log()
    await live.until(lambda: finished_of_live(live, task.task_id), 120)
    await assert_run_once_by(nc, task.task_id, holder_node)
    assert not accepted_by(other_node)
    assert "redelivered while it is held here: kept, not run twice" in holder.log()
    await nc.close()
