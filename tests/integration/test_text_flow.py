"""Text generation end to end: nats-server, `fleet worker`, runner subprocess, mlx-lm."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import nats
import pytest

from fleet.models.catalog import get_card
from fleet.wire import subjects
from fleet.wire.events import ErrorReason, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WarmStack, WorkerFactory
from tests.integration.harness import (
    REPO,
    client,
    events_of,
    finished,
    place_and_wait,
    run_task,
    serving,
    submit,
    until_queue_empty,
    wait_node,
    wait_runner,
)


def chat(task_id: str, text: str, model: str = "tiny-llm", **fields: object) -> TextGeneration:
    defaults: dict[str, object] = {"max_tokens": 8, "temperature": 0.0}
    return TextGeneration(
        task_id=task_id, model=model, messages=[ChatMessage(role="user", content=text)],
        **{**defaults, **fields},
    )


async def test_raw_nats_client_gets_paris_from_smollm2_with_the_readme_json(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path
) -> None:
    worker = start_worker(models={"smollm2-135m": smollm2_dir})
    nc = await client(nats_url)
    node = await wait_node(nc, worker.data_dir)
    await place_and_wait(nc, get_card("smollm2-135m"), node)

    # Only nats-py and the README's JSON from here: what a NATS CLI user does.
    raw = await nats.connect(nats_url)
    task = json.loads((REPO / "schemas/examples/nats-cli-task.json").read_text())
    got: list[dict[str, object]] = []
    done = asyncio.Event()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        got.append(json.loads(msg.data))
        if got[-1]["type"] == "task_finished":
            done.set()

    await raw.subscribe(f"fleet.out.{task['task_id']}", cb=on_event)
    await raw.jetstream().publish("fleet.tasks.smollm2-135m", json.dumps(task).encode())
    await asyncio.wait_for(done.wait(), 120)
    await raw.close()

    assert got[0]["type"] == "task_accepted"
    text = "".join(str(e["text"]) for e in got if e["type"] == "token")
    assert "Paris" in text
    assert got[-1]["status"] == "completed"
    await nc.close()


async def test_four_concurrent_tasks_share_one_batch_and_all_complete(
    warm_tiny_llm: WarmStack
) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    tasks = [chat(f"batch-{i}", f"hello number {i}", max_tokens=48) for i in range(4)]
    collectors = [asyncio.create_task(events_of(nc, t.task_id)) for t in tasks]
    await asyncio.gather(*(submit(nc, t) for t in tasks))
    results = [finished(events) for events in await asyncio.gather(*collectors)]
    assert all(r.status == "completed" for r in results)
    assert max(r.stats.batched_with or 0 for r in results if r.stats) >= 1
    await nc.close()


async def test_same_seed_gives_the_same_text(warm_tiny_llm: WarmStack) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    texts = []
    for task_id in ("seed-a", "seed-b"):
        task = chat(task_id, "tell me a story", temperature=1.0, seed=1234, max_tokens=24)
        events = await run_task(nc, task)
        assert finished(events).status == "completed"
        texts.append([i for e in events if isinstance(e, TokenChunk) for i in e.ids])
    assert texts[0] == texts[1] and len(texts[0]) > 0
    await nc.close()


async def test_cancel_mid_stream_ends_cancelled(
    warm_tiny_llm: WarmStack
) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    task = chat("cancel-me", "go on forever", max_tokens=100000, logit_bias={0: -100.0})
    first_token = asyncio.Event()
    seen: list[TaskFinished] = []

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        body = json.loads(msg.data)
        if body["type"] == "token":
            first_token.set()
        if body["type"] == "task_finished":
            seen.append(TaskFinished.model_validate(body))

    await nc.subscribe(subjects.out(task.task_id), cb=on_event)
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await asyncio.wait_for(first_token.wait(), 60)
    await nc.publish(subjects.cancel(task.task_id), b'{"type":"cancel_task","task_id":"cancel-me"}')
    result = finished(await collector)
    assert result.status == "cancelled"
    assert result.reason is ErrorReason.CANCELLED
    await nc.close()


async def test_runner_sigkill_mid_task_ends_runner_crashed_and_runner_restarts(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc, record = await serving(nats_url, start_worker(), get_card("tiny-llm"))
    # Not continued (max_continuations 0): tests/integration/test_continuation.py does that.
    task = chat(
        "crash-me", "long", max_tokens=100000, logit_bias={0: -100.0}, max_continuations=0
    )
    collector = asyncio.create_task(events_of(nc, task.task_id))
    first_token = asyncio.Event()
    await nc.subscribe(subjects.out(task.task_id), cb=partial(_set_on_token, event=first_token))
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    await submit(nc, task)
    await asyncio.wait_for(first_token.wait(), 60)
    runner_pid = _runner_pid(record.runner_id)
    os.kill(runner_pid, signal.SIGKILL)
    result = finished(await collector)
    assert result.status == "failed" and result.reason is ErrorReason.RUNNER_CRASHED
    assert "SIGKILL" in (result.message or "")
    await wait_runner(watcher, "tiny-llm", ("ready",), 60, other_than=record.runner_id)
    after = chat("after-crash", "hello")
    assert finished(await run_task(nc, after)).status == "completed"
    await nc.close()


async def _set_on_token(msg: nats.aio.msg.Msg, event: asyncio.Event) -> None:
    if b'"type":"token"' in msg.data:
        event.set()


def _runner_pid(runner_id: str) -> int:
    """The runner subprocess's pid, found by its spec on the command line."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"fleet.runner.main" in cmdline and runner_id.encode() in cmdline:
                return int(entry.name)
    raise LookupError(f"no process for runner {runner_id}")


async def test_deadline_in_the_past_ends_expired(
    warm_tiny_llm: WarmStack
) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    task = chat("too-late", "hi", deadline=datetime.now(UTC) - timedelta(seconds=1))
    result = finished(await run_task(nc, task))
    assert result.status == "expired" and result.reason is ErrorReason.DEADLINE
    await nc.close()


async def test_prompt_longer_than_the_context_fails_context_length(
    warm_tiny_llm: WarmStack
) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    task = chat("too-long", "word " * 5000)
    result = finished(await run_task(nc, task))
    assert result.status == "failed" and result.reason is ErrorReason.CONTEXT_LENGTH
    await nc.close()


async def test_unknown_model_ends_model_not_found(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc = await client(nats_url)
    await wait_node(nc, worker.data_dir)
    task = chat("no-such", "hi", model="no-such-model")
    result = finished(await run_task(nc, task))
    assert result.status == "failed" and result.reason is ErrorReason.MODEL_NOT_FOUND
    # Purged: an unknown model's queue never fills. The message goes after its terminal is
    # stored (stored first, then removed), so wait for it rather than read the state at once.
    await until_queue_empty(nc.jetstream())
    await nc.close()


PUBLISH_TIMEOUT_S = 30.0


@pytest.mark.parametrize("count", [50])
async def test_malformed_messages_are_answered_and_the_worker_keeps_serving(
    warm_tiny_llm: WarmStack, count: int
) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    js = nc.jetstream()
    bad_ids = [f"bad-{i}" for i in range(count // 2)]
    collectors = [asyncio.create_task(events_of(nc, task_id)) for task_id in bad_ids]
    # Each publish waits for its store's ack: nats-py's 5 s default ran out once in a loaded
    # CI run (load ~16, a CPU hog beside it); the publishes are the setup, not what is tested.
    for i, task_id in enumerate(bad_ids):  # schema violations with a readable id
        await js.publish("fleet.tasks.tiny-llm", json.dumps(
            {"type": "text_generation", "task_id": task_id, "model": "tiny-llm",
             "messages": [{"role": "user", "content": "x"}], "max_tokens": -i - 1}
        ).encode(), timeout=PUBLISH_TIMEOUT_S)
    for i in range(count - len(bad_ids)):  # bytes that are not even JSON
        await js.publish("fleet.tasks.tiny-llm", b"\xff\x00 not json " + str(i).encode(),
                         timeout=PUBLISH_TIMEOUT_S)
    good = chat("good-after-bad", "hello")
    good_collector = asyncio.create_task(events_of(nc, good.task_id))
    await submit(nc, good)
    for events in await asyncio.gather(*collectors):
        result = finished(events)
        assert result.status == "failed" and result.reason is ErrorReason.INVALID_TASK
    assert finished(await good_collector).status == "completed"
    await until_queue_empty(js)
    await nc.close()



async def test_fleet_submit_with_a_json_schema_prints_json_that_matches_it(
    warm_tiny_llm: WarmStack, tmp_path: Path
) -> None:
    nc = await client(warm_tiny_llm.nats_url)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    submitted = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli", "submit", "--model", "tiny-llm",
        "--json-schema", str(tmp_path / "schema.json"), "Is Paris in France?", cwd=REPO,
        env={**os.environ, "FLEET_NATS_URL": warm_tiny_llm.nats_url},
        stdout=asyncio.subprocess.PIPE,
    )
    printed = (await submitted.communicate())[0].decode()
    assert submitted.returncode == 0, printed
    answer, status = printed.strip().splitlines()
    assert json.loads(answer) in ({"answer": "yes"}, {"answer": "no"})
    assert status.startswith("[completed")
    await nc.close()
