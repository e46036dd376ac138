"""A task's last token events stored inside its terminal (issue 23), through a real stack: a
`fleet up` of the fault engine, its nats-server, its gateway. A max_tokens-1 task and a
multi-token one read the same through NATS (a plain subscriber, the stored stream) and HTTP
(`/v1/tasks/<id>/events`), and a one-token task is stored in two messages, not three."""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path

import httpx
import pytest
from nats.aio.msg import Msg

from bench.fleet_stack import FleetStack
from bench.plumbing_rate import MODEL, seed_fault_card
from fleet.bus.connect import js_publish
from fleet.bus.task_log import TaskLog
from fleet.wire import subjects
from fleet.wire.codec import decode_event, encode, expand_all
from fleet.wire.events import OutputEvent, TaskFinished, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.test_full_rate import _env

pytestmark = pytest.mark.timeout(300)


async def _run(stack: FleetStack, tokens: int) -> tuple[str, list[bytes]]:
    """Publish a task of `tokens` tokens; the messages a plain subscriber got, in order."""
    assert stack.nc is not None
    task_id = f"tail-{secrets.token_hex(6)}"
    got: list[bytes] = []
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)
        if isinstance(decode_event(msg.data), TaskFinished):
            done.set()

    sub = await stack.nc.subscribe(subjects.out(task_id), cb=on_msg)
    try:
        await js_publish(stack.nc.jetstream(), subjects.tasks(MODEL), TextGeneration(
            task_id=task_id, model=MODEL, max_tokens=tokens,
            messages=[ChatMessage(role="user", content=f"tokens:{tokens}")]), msg_id=task_id)
        await asyncio.wait_for(done.wait(), 120)
    finally:
        await sub.unsubscribe()
    return task_id, got


def _native(body: str) -> list[bytes]:
    """The data of each SSE event of a native `/v1/tasks/<id>/events` body."""
    return [line[len("data: "):].encode() for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.skipif(sys.platform != "linux", reason="fleet up's process tree is read via psutil")
async def test_a_terminals_last_tokens_read_the_same_through_nats_and_http(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "fleet-data"
    seed_fault_card(data_dir)
    stack = FleetStack(data_dir, [MODEL], 4, _env())
    await stack.start()
    try:
        runs = [await _run(stack, tokens) for tokens in (1, 1, 1, 1, 1, 1, 7)]
        assert stack.nc is not None
        stored = [[data for _, data in await TaskLog(stack.nc).raw(task_id)]
                  for task_id, _ in runs]
        async with httpx.AsyncClient(timeout=60.0) as client:
            over_http = [_native((await client.get(
                f"{stack.base_url}/tasks/{task_id}/events?format=native")).text)
                for task_id, _ in runs]
    finally:
        await stack.stop()

    for (task_id, live), kept, http, tokens in zip(runs, stored, over_http,
                                                  (1, 1, 1, 1, 1, 1, 7), strict=True):
        assert kept == live, task_id  # the stream holds what a subscriber saw, in order
        events: list[OutputEvent] = expand_all(decode_event(data) for data in live)
        assert http == [encode(event) for event in events], task_id  # event for event, bytes
        assert token_indexes(events) == list(range(tokens))
        assert events[0].type == "task_accepted"
        assert isinstance(events[-1], TaskFinished) and events[-1].status == "completed"
        assert events[-1].last_tokens is None  # as readers take it
    # The runner writes a one-token task's token and terminal in one step: read together,
    # they are stored as one message (the accept and the terminal, not three).
    assert any(len(kept) == 2 for kept in stored[:6]), [len(kept) for kept in stored]
