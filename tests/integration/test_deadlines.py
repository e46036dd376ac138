"""Deadlines in the broker, against nats-server and one `fleet worker` (fault engine): a task
whose deadline passes in the queue ends `expired` without any worker pulling it, and the
broker drops its message (per-message TTL); a task that started in time is not touched."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from fleet.bus.connect import js_publish
from fleet.bus.deadlines import STREAM, deadline_subject, expires, publish_deadline, ttl_header
from fleet.bus.embedded import EmbeddedNats
from fleet.wire import subjects
from fleet.wire.events import TaskFinished
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.janitor import DEADLINES_DURABLE as DURABLE
from tests.integration.harness import (
    WorkerProcess,
    add_fault_card,
    client,
    events_of,
    place_and_wait,
    wait_node,
)

pytestmark = pytest.mark.timeout(180)

SERVED = "fault-llm"
IDLE = "fault-idle"  # known to the worker (a card), never placed: its queue is never pulled


@pytest.fixture(scope="module")
def worker_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("deadlines")
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as server:
        data = root / "worker"
        data.mkdir()
        add_fault_card(data, IDLE)
        card = add_fault_card(data, SERVED)
        worker = WorkerProcess(server.url, data).start()
        try:

            async def place() -> None:
                nc = await client(server.url)
                await place_and_wait(nc, card, await wait_node(nc, data))
                await nc.close()

            asyncio.run(place())
            yield server.url, data
        finally:
            worker.kill()


@pytest.fixture
async def nc(worker_stack: tuple[str, Path]) -> AsyncIterator[Client]:
    connection = await client(worker_stack[0])
    yield connection
    await connection.close()


def task(model: str, deadline_s: float) -> TextGeneration:
    return TextGeneration(
        task_id=f"dl-{secrets.token_hex(6)}", model=model, max_tokens=4,
        deadline=datetime.now(UTC) + timedelta(seconds=deadline_s),
        messages=[ChatMessage(role="user", content="tokens:3")],
    )


async def marker_of(nc: Client, subject: str, timeout: float = 30.0) -> None:
    """Until the server has put the expiry marker where the task's sentinel was."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(NotFoundError):
            last = await js.get_last_msg(STREAM, subject)
            if expires(dict(last.headers or {})):
                return
        await asyncio.sleep(0.2)  # polling the stream, bounded by the deadline
    raise TimeoutError(f"no expiry marker on {subject}")


async def markers_settled(nc: Client, timeout: float = 30.0) -> None:
    """Until the shared consumer of expiry markers has handled every marker stored so far."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = await js.consumer_info(STREAM, DURABLE)
        if not info.num_pending and not info.num_ack_pending:
            return
        await asyncio.sleep(0.1)  # polling the broker's count, bounded by the deadline
    raise TimeoutError("the deadline markers were not all handled")


async def test_a_task_past_its_deadline_in_the_queue_expires_unpulled(nc: Client) -> None:
    late = task(IDLE, 1.0)
    headers = ttl_header(late.deadline, time.time())
    events = asyncio.ensure_future(events_of(nc, late.task_id, timeout=30))
    await js_publish(nc.jetstream(), subjects.tasks(IDLE), late, msg_id=late.task_id,
                     extra_headers=headers)
    await publish_deadline(nc.jetstream(), late)  # as the gateway does for what it publishes
    (finished,) = await events
    assert isinstance(finished, TaskFinished)
    assert (finished.status, finished.reason) == ("expired", "deadline")
    assert "before it started" in (finished.message or "")
    depth = await nc.jetstream().stream_info(subjects.TASKS_STREAM,
                                             subjects_filter=subjects.tasks(IDLE))
    assert not (depth.state.subjects or {}).get(subjects.tasks(IDLE))  # the broker dropped it


async def test_a_task_that_started_in_time_is_not_expired(nc: Client) -> None:
    prompt = task(SERVED, 2.0)
    reader = asyncio.ensure_future(events_of(nc, prompt.task_id, timeout=30))
    await js_publish(nc.jetstream(), subjects.tasks(SERVED), prompt, msg_id=prompt.task_id)
    await publish_deadline(nc.jetstream(), prompt)
    done = await reader
    assert isinstance(done[-1], TaskFinished) and done[-1].status == "completed"
    stored = await stored_on_out(nc, prompt.task_id)  # the terminal is its last message
    # Past the deadline, its marker arrives and is handled: the task keeps one terminal.
    await marker_of(nc, deadline_subject(SERVED, prompt.task_id))
    await markers_settled(nc)
    assert await stored_on_out(nc, prompt.task_id) == stored  # nothing stored after it


async def stored_on_out(nc: Client, task_id: str) -> int:
    """The messages FLEET_OUT holds of the task (a terminal may hold its last token events
    too: not the count of events read)."""
    info = await nc.jetstream().stream_info(subjects.OUT_STREAM,
                                            subjects_filter=subjects.out(task_id))
    return (info.state.subjects or {}).get(subjects.out(task_id), 0)
