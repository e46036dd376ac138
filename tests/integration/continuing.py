"""Helpers of the continuation tests: placing a model on one node, a live view of every
task's events, and the check that a continued stream equals its uninterrupted run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.placement import place
from fleet.wire import subjects
from fleet.wire.cluster import ModelCard, RunnerRecord
from fleet.wire.codec import decode_events, decode_model
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import Task
from tests.integration.harness import WorkerProcess, events_of, submit

ENV = {"FLEET_ACK_WAIT_S": "2", "OPENBLAS_NUM_THREADS": "1"}
NO_EOS = {2: -100.0}  # tiny-llm's <|im_end|>: random weights would otherwise stop early


async def place_on(
    nc: Client, card: ModelCard, node: str, timeout: float = 120.0, slots: int = 8
) -> RunnerRecord:
    """Place `card` on `node` and wait for that node's runner to be ready."""
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    await place(nc.jetstream(), card, node_id=node, slots=slots)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                continue
            if entry is None or not entry.value:
                continue
            record = decode_model(RunnerRecord, entry.value)
            if record.node_id == node and record.status.state == "ready":
                return record
    finally:
        await watcher.stop()
    raise TimeoutError(f"no ready runner on {node}")


class Live:
    """Every task's events as a live subscriber sees them, with arrival times."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[float, OutputEvent]]] = {}
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        if msg.subject.endswith(".fence"):  # a takeover's fence (fleet.bus.task_log), no event
            return
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            self.events.setdefault(event.task_id, []).append((time.monotonic(), event))
            self.changed.set()

    async def until(self, check: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := check()):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.01, deadline - time.monotonic()))
        return found

    def tokens(self, task_id: str) -> int:
        return sum(e.count for _, e in self.events.get(task_id, []) if isinstance(e, TokenChunk))

    def node_running(self, task_id: str) -> str | None:
        accepted = [e for _, e in self.events.get(task_id, []) if isinstance(e, TaskAccepted)]
        return accepted[-1].node_id if accepted else None

    def done(self, task_id: str) -> bool:
        return any(isinstance(e, TaskFinished) for _, e in self.events.get(task_id, []))


def assert_one_clean_stream(events: list[OutputEvent], reference: list[OutputEvent]) -> None:
    tokens = [e for e in events if isinstance(e, TokenChunk)]
    expected = [e for e in reference if isinstance(e, TokenChunk)]
    # A token event may carry several tokens (the runner coalesces them by timing): compare
    # token by token, not event by event.
    indexes = [t.index + k for t in tokens for k in range(t.count)]
    assert indexes == list(range(len(indexes))), "a repeated or missing index"
    got_ids, want_ids = [i for t in tokens for i in t.ids], [i for t in expected for i in t.ids]
    split = next((n for n, (a, b) in enumerate(zip(got_ids, want_ids, strict=False)) if a != b),
                 min(len(got_ids), len(want_ids)))
    continued = [e.continued_from for e in events if isinstance(e, TaskAccepted)]
    assert got_ids == want_ids, (
        f"tokens differ from index {split} of {len(got_ids)} (reference {len(want_ids)}); "
        f"attempts continued from {continued}")
    assert "".join(t.text for t in tokens) == "".join(t.text for t in expected)
    # Logprobs continue; batches of other shapes move them by float rounding only. (Tokens
    # with logprobs travel one to an event.)
    with_logprobs = [t.logprob for t in tokens if t.logprob is not None]
    assert with_logprobs == pytest.approx(
        [t.logprob for t in expected if t.logprob is not None], abs=1e-3)
    terminals = [e for e in events if isinstance(e, TaskFinished)]
    assert len(terminals) == 1 and events[-1] is terminals[0]
    [want] = [e for e in reference if isinstance(e, TaskFinished)]
    assert terminals[0].status == "completed", terminals[0]
    assert terminals[0].finish_reason == want.finish_reason
    assert terminals[0].usage is not None and want.usage is not None
    assert terminals[0].usage.completion_tokens == len(indexes) == want.usage.completion_tokens


def finished_of(events: list[OutputEvent]) -> TaskFinished:
    [terminal] = [e for e in events if isinstance(e, TaskFinished)]
    return terminal


def runner_pid(runner_id: str) -> int:
    """The runner subprocess's pid, found by its id on its command line."""
    found = [
        int(entry.name) for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and b"fleet.runner.main" in (line := cmdline(entry))
        and runner_id.encode() in line
    ]
    assert len(found) == 1, found
    return found[0]


def cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


def first_after(live: Live, task_id: str) -> float | None:
    """Arrival time of the first token of the next attempt (a later task_accepted)."""
    attempts = 0
    for at, event in live.events.get(task_id, []):
        if isinstance(event, TaskAccepted):
            attempts += 1
        elif isinstance(event, TokenChunk) and attempts >= 2:
            return at
    return None


def dedup(events: list[OutputEvent]) -> list[OutputEvent]:
    """A live core subscriber may also see a token the dead worker published twice (its
    retry): JetStream stores it once (Msg-Id); the live view keeps the first by index."""
    seen: set[int] = set()
    kept: list[OutputEvent] = []
    for event in events:
        if isinstance(event, TokenChunk):
            if event.index in seen:
                continue
            seen.update(range(event.index, event.next_index))
        kept.append(event)
    return kept


async def run_whole(nc: Client, task: Task) -> list[OutputEvent]:
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    return await collector


def assert_came_back_here(accepted: list[TaskAccepted], worker: WorkerProcess) -> None:
    """A task its worker gave back when its runner died (no other runner of the model ready
    on the node) and that came back to that worker, with no other worker to take it: its next
    delivery, or the one after when the worker's own pull request, still open on the server,
    caught it while the runner restarted and the request ran out first (fleet.worker.pulls
    gives such a task back, and logs it by id: each such give-back is one delivery more)."""
    task_id = accepted[0].task_id
    lingered = worker.log().count(f"({task_id}) reached a wait this worker had left")
    assert accepted[1].delivery == accepted[0].delivery + 1 + lingered, (accepted, lingered)
    assert accepted[1].moved_from == accepted[0].node_id == accepted[1].node_id
