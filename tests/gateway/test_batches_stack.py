"""The official `openai` client's files and batches calls, and Idempotency-Key, against real
processes: nats-server, a `fleet worker` serving the fault engine, and two `fleet gateway`
replicas (a third, made per test, is SIGKILLed mid-job). One stack for the module."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from nats.js.api import DeliverPolicy

from fleet.bus.connect import connect
from fleet.bus.embedded import EmbeddedNats
from fleet.wire.codec import decode_event
from fleet.wire.events import TaskAccepted
from tests.gateway_process import GatewayProcess
from tests.integration.harness import (
    REPO,
    WorkerProcess,
    add_fault_card,
    client,
    place_and_wait,
    wait_node,
)

# the openai client is imported where used, not at the top: collection imports this module
# in every xdist worker (0.7 s of CPU; issue 28).
if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]

MODEL = "fault-llm"
TOKENS = 6
EXPECTED = "".join(f" t{i}" for i in range(TOKENS))


def gateway(nats_url: str, data_dir: Path) -> GatewayProcess:
    """A gateway process that knows the fault engine's card."""
    add_fault_card(data_dir, MODEL)
    return GatewayProcess(nats_url, data_dir)


@dataclass(frozen=True)
class Stack:
    nats_url: str
    root: Path
    a: GatewayProcess
    b: GatewayProcess


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("batches")
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as server:
        worker_dir = root / "worker"
        worker_dir.mkdir()
        card = add_fault_card(worker_dir, MODEL)
        worker = WorkerProcess(server.url, worker_dir).start()
        a = gateway(server.url, root / "a")
        b = gateway(server.url, root / "b")
        try:

            async def place() -> None:
                nc = await client(server.url)
                await place_and_wait(nc, card, await wait_node(nc, worker_dir), slots=8)
                await nc.close()

            asyncio.run(place())
            a.wait_listening()
            b.wait_listening()
            yield Stack(server.url, root, a, b)
        finally:
            a.stop()
            b.stop()
            worker.kill()


def jsonl(lines: int, delay_ms: int = 0, tag: str = "") -> bytes:
    knobs = f"tokens:{TOKENS}" + (f" delay_ms:{delay_ms}" if delay_ms else "")
    return b"".join(json.dumps({
        "custom_id": f"req-{tag}{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 32,
                 "messages": [{"role": "user", "content": f"{knobs} line {i}"}]},
    }).encode() + b"\n" for i in range(lines))


def wait_batch(sdk: openai.OpenAI, batch_id: str, until: object, timeout: float = 120.0):
    """Polls the job (the API has no push) until `until(batch)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if until(batch):  # type: ignore[operator]
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} stayed {batch.status} {batch.request_counts}")
        time.sleep(0.2)


async def accepted_per_task(nats_url: str, prefix: str) -> Counter[str]:
    """How many times each task whose id starts with `prefix` was accepted by a worker."""
    nc = await connect(nats_url, "test-reader")
    found: Counter[str] = Counter()
    try:
        js = nc.jetstream()
        sub = await js.subscribe("fleet.out.>", ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
        pending = (await js.stream_info("FLEET_OUT")).state.messages
        for _ in range(pending):
            msg = await sub.next_msg(timeout=10)
            if msg.subject.startswith(f"fleet.out.{prefix}") and not msg.subject.endswith(
                    ".fence"):
                event = decode_event(msg.data)
                if isinstance(event, TaskAccepted):
                    found[event.task_id] += 1
        await sub.unsubscribe()
    finally:
        await nc.close()
    return found


def test_a_batch_survives_its_gateway_sigkill(stack: Stack) -> None:
    victim = gateway(stack.nats_url, stack.root / f"victim-{time.monotonic_ns()}")
    try:
        sdk = victim.sdk()
        upload = sdk.files.create(file=("input.jsonl", io.BytesIO(jsonl(40, delay_ms=150))),
                                  purpose="batch")
        assert upload.purpose == "batch" and upload.bytes > 0
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={"run": "sigkill"})
        assert batch.status in ("validating", "in_progress")
        other = stack.b.sdk()
        wait_batch(other, batch.id, lambda b: b.request_counts.completed >= 3, timeout=60)
        victim.kill()  # mid-job: its lease lapses and gateway a or b goes on
        done = wait_batch(other, batch.id, lambda b: b.status == "completed", timeout=150)
    finally:
        victim.kill()
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (40, 40, 0)
    assert done.metadata == {"run": "sigkill"} and done.error_file_id is None
    lines = [json.loads(x) for x in other.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(40))
    for line in lines:
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["message"]["content"] == EXPECTED
    accepted = asyncio.run(accepted_per_task(stack.nats_url, batch.id))
    assert len(accepted) == 40 and set(accepted.values()) == {1}  # nothing ran twice
    took_over = f"batch {batch.id}: lease taken over"
    assert any(took_over in g.log_path.read_text() for g in (stack.a, stack.b))


def test_files_and_batches_calls_of_the_sdk(stack: Stack) -> None:
    import openai

    sdk = stack.a.sdk()
    data = jsonl(3, tag="f") + b'{"custom_id": "bad", "method": "POST", ' \
        b'"url": "/v1/chat/completions", "body": {"model": "no-such-model", "messages": []}}\n'
    upload = sdk.files.create(file=("mixed.jsonl", io.BytesIO(data)), purpose="batch")
    assert sdk.files.retrieve(upload.id).filename == "mixed.jsonl"
    assert sdk.files.content(upload.id).content == data
    assert upload.id in [f.id for f in stack.b.sdk().files.list(purpose="batch").data]
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    done = wait_batch(stack.b.sdk(), batch.id, lambda b: b.status == "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    errors = [json.loads(x) for x in sdk.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    assert batch.id in [b.id for b in sdk.batches.list(limit=100).data]
    assert sdk.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(upload.id)


def test_a_cancelled_batch_stops(stack: Stack) -> None:
    sdk = stack.a.sdk()
    upload = sdk.files.create(file=("slow.jsonl", io.BytesIO(jsonl(60, delay_ms=200, tag="c"))),
                              purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_batch(sdk, batch.id, lambda b: b.status == "in_progress")
    assert stack.b.sdk().batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_batch(sdk, batch.id, lambda b: b.status == "cancelled")
    assert done.request_counts.completed < 60 and done.cancelled_at is not None


def test_invalid_input_fails_the_batch(stack: Stack) -> None:
    sdk = stack.a.sdk()
    data = jsonl(2) + b"not json\n"
    upload = sdk.files.create(file=("broken.jsonl", io.BytesIO(data)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    done = wait_batch(sdk, batch.id, lambda b: b.status == "failed")
    assert done.errors and done.errors.data[0].code == "invalid_json_line"
    assert done.errors.data[0].line == 2


def test_an_idempotent_retry_on_another_replica_attaches(stack: Stack) -> None:
    key = f"retry-{time.monotonic_ns()}"
    body = {"model": MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": "tokens:5 delay_ms:100"}]}
    headers = {"Idempotency-Key": key}
    first = httpx.post(f"{stack.a.url}/v1/chat/completions", json=body, headers=headers,
                       timeout=60)
    again = httpx.post(f"{stack.b.url}/v1/chat/completions", json=body, headers=headers,
                       timeout=60)
    assert first.status_code == again.status_code == 200, again.text
    task_id = first.headers["x-fleet-task-id"]
    assert again.headers["x-fleet-task-id"] == task_id
    assert again.headers["x-fleet-idempotent-replay"] == "true"
    assert again.json()["choices"] == first.json()["choices"]
    other = httpx.post(f"{stack.b.url}/v1/chat/completions", headers=headers, timeout=60,
                       json={**body, "max_tokens": 17})
    assert other.status_code == 409
    assert asyncio.run(accepted_per_task(stack.nats_url, task_id)) == {task_id: 1}


def test_the_cli_shows_progress(stack: Stack) -> None:
    sdk = stack.a.sdk()
    upload = sdk.files.create(file=("cli.jsonl", io.BytesIO(jsonl(4, tag="cli"))),
                              purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_batch(sdk, batch.id, lambda b: b.status == "completed")

    def fleet(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fleet.cli", "--nats-url", stack.nats_url,
                               "batches", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    shown = json.loads(fleet("show", batch.id))
    assert (shown["status"], shown["request_counts"]) == (
        "completed", {"total": 4, "completed": 4, "failed": 0})
    row = next(line for line in fleet("list").splitlines() if line.startswith(batch.id))
    assert "completed" in row and "4/4" in row and "100.0%" in row
