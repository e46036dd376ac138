"""A dead worker is seen from its connection, a paused one is not (fleet.worker.deathwatch).

Real processes: nats-server and two `fleet worker`s serving the fault engine (a plumbing
double: " t0 t1 ..." at a fixed pace), with an AckWait far longer than the test waits, so
only the death watch can move a task:

- SIGKILL of the worker streaming a task: its subscription on `fleet.alive.<node>` is gone at
  once, the watcher (the sweeper's holder, or the sentinel when the dead one swept) naks the
  task message its heartbeat listed, and the other worker continues it from the next token.
- SIGKILL of a worker the moment its task's `task_accepted` appears (milliseconds after it
  took the message, before any token): its heartbeat listed the message before the intake
  began (fleet.worker.heartbeat, `list_held`), so the task goes on elsewhere in seconds.
  Before, a hold was listed by a poll every 50 ms, and such a kill left the task to AckWait.
- SIGSTOP of that worker for longer than the watch's confirmation: probes go unanswered
  (silent, not "no responders"), nothing is taken over, and after SIGCONT the same worker
  ends the task in one attempt.
"""

from __future__ import annotations

import os
import signal
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.wire.codec import decode_event
from fleet.wire.events import TaskAccepted, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import Live, finished_of, first_after, place_on
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    client,
    events_of,
    submit,
    wait_node,
)

# AckWait far beyond every wait below: a redelivery by AckWait would fail the test.
ENV = {"FLEET_ACK_WAIT_S": "300", "OPENBLAS_NUM_THREADS": "1"}
TOKENS = 120


async def _two_workers(nc: Client, start_worker: WorkerFactory) -> dict[str, WorkerProcess]:
    nodes: dict[str, WorkerProcess] = {}
    for name in ("a", "b"):
        worker = start_worker(name, **ENV)
        card = add_fault_card(worker.data_dir)
        node = await wait_node(nc, worker.data_dir)
        await place_on(nc, card, node)
        nodes[node] = worker
    return nodes


def _task(task_id: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content=f"tokens:{TOKENS} delay_ms:80")],
    )


async def test_a_killed_worker_is_seen_gone_and_its_task_continues_long_before_ack_wait(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    nodes = await _two_workers(nc, start_worker)
    live = Live()
    await nc.subscribe("fleet.out.*", cb=live.on_msg)
    task = _task("killed")
    await submit(nc, task)
    # Past the watchers' start (a watch trusts absences once its own link is 5 s old).
    await live.until(lambda: live.tokens(task.task_id) >= 8, 60)
    killed_node = live.node_running(task.task_id)
    assert killed_node is not None
    killed_at = time.monotonic()
    nodes[killed_node].kill()
    resumed = await live.until(lambda: first_after(live, task.task_id), 120)
    print(f"\nkill seam (SIGKILL -> next token, AckWait {ENV['FLEET_ACK_WAIT_S']} s): "
          f"{resumed - killed_at:.2f} s")
    await live.until(lambda: live.done(task.task_id), 120)
    events = await events_of(nc, task.task_id)
    indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
    assert indexes == list(range(TOKENS)), "a gap or a duplicate in the stored stream"
    assert finished_of(events).status == "completed"
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1]
    assert accepted[1].moved_from == killed_node and accepted[1].node_id != killed_node
    await nc.close()


async def test_a_worker_killed_as_it_takes_a_task_hands_it_on_long_before_ack_wait(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    nodes = await _two_workers(nc, start_worker)
    live = Live()
    task = _task("killed-at-take")
    killed: dict[str, float | str] = {}

    async def kill_at_accept(msg: Msg) -> None:
        # In the subscription's callback, before anything else is read: the kill lands a
        # few milliseconds after the worker took the message (its runner has just said
        # task_accepted), long before a token.
        if msg.subject.endswith(".fence") or killed:
            return
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted) and event.task_id == task.task_id:
            process = nodes[event.node_id].process
            assert process is not None
            os.killpg(process.pid, signal.SIGKILL)
            killed.update(at=time.monotonic(), node=event.node_id)

    await nc.subscribe(f"fleet.out.{task.task_id}", cb=kill_at_accept)
    await nc.subscribe("fleet.out.*", cb=live.on_msg)
    await submit(nc, task)
    resumed = await live.until(lambda: first_after(live, task.task_id), 120)
    seam = resumed - float(killed["at"])
    await live.until(lambda: live.done(task.task_id), 120)
    events = await events_of(nc, task.task_id)
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    print(f"\nkill at task_accepted -> the next attempt's first token: {seam:.2f} s "
          f"(AckWait {ENV['FLEET_ACK_WAIT_S']} s)")
    assert seam < 30.0, "taken over no sooner than the default AckWait"
    indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
    assert indexes == list(range(TOKENS)), "a gap or a duplicate in the stored stream"
    assert finished_of(events).status == "completed"
    # Nothing had streamed: the other worker runs it from the start, a first attempt again.
    assert [e.node_id == killed["node"] for e in accepted] == [True, False]
    await nc.close()


async def test_a_paused_worker_is_not_taken_for_dead(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    nodes = await _two_workers(nc, start_worker)
    live = Live()
    await nc.subscribe("fleet.out.*", cb=live.on_msg)
    task = _task("paused-alive")
    await submit(nc, task)
    await live.until(lambda: live.tokens(task.task_id) >= 8, 60)
    paused_node = live.node_running(task.task_id)
    assert paused_node is not None
    process = nodes[paused_node].process
    assert process is not None
    os.killpg(process.pid, signal.SIGSTOP)  # worker and runner: a frozen machine
    try:
        # Ten probe rounds and more: every one unanswered, none "no responders".
        await live.until(lambda: first_after(live, task.task_id), 8)
        raise AssertionError("a paused worker's task was taken over")
    except TimeoutError:
        pass
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    await live.until(lambda: live.done(task.task_id), 120)
    events = await events_of(nc, task.task_id)
    assert [e.attempt for e in events if isinstance(e, TaskAccepted)] == [0]
    indexes = token_indexes([e for e in events if isinstance(e, TokenChunk)])
    assert indexes == list(range(TOKENS))
    assert finished_of(events).status == "completed"
    await nc.close()
