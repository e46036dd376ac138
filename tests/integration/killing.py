"""The kill-a-worker-mid-task scenario, once: a worker takes a task, is SIGKILLed (worker and
runners, as a power loss) at a chosen event of it, and a second worker starts serving the
model. What the task then did is the caller's to check."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.wire import subjects
from fleet.wire.codec import decode_events
from fleet.wire.events import OutputEvent, TaskAccepted, TokenChunk
from fleet.wire.tasks import Task
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import place_on
from tests.integration.harness import WorkerProcess, add_fault_card, events_of, submit, wait_node

# Starts a worker by name and returns it with its node once the model is ready there.
StartServing = Callable[[str], Awaitable[tuple[WorkerProcess, str]]]


@dataclass
class Killed:
    events: list[OutputEvent]  # the task's every event from FLEET_OUT, its terminal one last
    first: WorkerProcess  # the one killed
    second: WorkerProcess
    second_node: str


def accepted(event: OutputEvent) -> bool:
    return isinstance(event, TaskAccepted)


def tokens_past(count: int) -> Callable[[OutputEvent], bool]:
    """A token event that takes the answer past `count` tokens (an event may carry several)."""
    return lambda event: isinstance(event, TokenChunk) and event.next_index > count


def fault_workers(nc: Client, start_worker: WorkerFactory, **env: str) -> StartServing:
    """Workers serving the fault engine's `fault-llm` (a plumbing double), each on its node."""

    async def start(name: str) -> tuple[WorkerProcess, str]:
        worker = start_worker(name, **env)
        card = add_fault_card(worker.data_dir)
        node = await wait_node(nc, worker.data_dir)
        await place_on(nc, card, node)
        return worker, node

    return start


async def kill_mid_task(
    nc: Client, task: Task, start: StartServing, at: Callable[[OutputEvent], bool],
    timeout: float = 120.0,
) -> Killed:
    """Worker "a" takes `task`; at its first event that `at` accepts, "a" is SIGKILLed and
    worker "b" starts. Every wait is on an event, bounded by `timeout`."""
    first, _ = await start("a")
    reached = asyncio.Event()

    async def watch(msg: Msg) -> None:
        if any(at(event) for event in decode_events(msg.data)):  # the last may ride the end
            reached.set()

    watcher = await nc.subscribe(subjects.out(task.task_id), cb=watch)
    collector = asyncio.create_task(events_of(nc, task.task_id, timeout))
    try:
        await submit(nc, task)
        await asyncio.wait_for(reached.wait(), timeout)
    finally:
        await watcher.unsubscribe()
    first.kill()
    second, second_node = await start("b")
    return Killed(await collector, first, second, second_node)
