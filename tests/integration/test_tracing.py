"""One trace per task, with real processes: nats-server, `fleet worker` and its runner
subprocess, `fleet gateway`, `fleet submit`, `fleet trace`, and an OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.task_log import TaskLog
from fleet.models.catalog import get_card
from fleet.placement import place
from fleet.trace.lookup import spans_of_trace, trace_id_of_task
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import TaskAccepted
from fleet.wire.tasks import ImageGeneration
from tests.gateway_process import GatewayProcess
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    REPO,
    client,
    events_of,
    finished,
    place_and_wait,
    wait_node,
)
from tests.integration.test_text_flow import chat
from tests.integration.tracing import (
    OtlpReceiver,
    Spans,
    by_name,
    has,
    otlp_env,
    trace_spans,
)

# the openai client is imported where used, not at the top: collection imports this module
# in every xdist worker (0.7 s of CPU; issue 28).

OUTSIDE_TRACE = "0af7651916cd43dd8448eb211c80319c"
OUTSIDE_SPAN = "b7ad6b7169203331"
TEXT_SPANS = (
    "process fleet.tasks.tiny-llm", "chat tiny-llm", "prefill", "decode",
    "send fleet.out.{task_id}",
)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver().running() as running:
        yield running


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    connection = await client(nats_url)
    yield connection
    await connection.close()


async def serve_tiny_llm(nc: Client, start_worker: WorkerFactory, receiver: OtlpReceiver) -> None:
    worker = start_worker(**otlp_env(receiver.endpoint))
    node = await wait_node(nc, worker.data_dir)
    await place_and_wait(nc, get_card("tiny-llm"), node)


def assert_text_tree(spans: Spans, parent_of_process: str) -> None:
    named = by_name(spans)
    process, generation = named["process fleet.tasks.tiny-llm"], named["chat tiny-llm"]
    assert process["parent_id"] == parent_of_process
    assert process["kind"] == "consumer"
    assert process["attributes"]["messaging.system"] == "nats"
    assert process["attributes"]["messaging.consumer.group.name"] == "tasks-tiny-llm"
    assert [e["name"] for e in process["events"]] == ["dispatch", "ack"]
    assert generation["parent_id"] == process["span_id"]
    assert generation["attributes"]["gen_ai.usage.output_tokens"] > 0
    assert named["prefill"]["parent_id"] == named["decode"]["parent_id"] == generation["span_id"]
    assert named["send fleet.out.{task_id}"]["parent_id"] == process["span_id"]
    assert {span["service"] for span in spans} >= {"fleet-worker", "fleet-runner"}


async def test_an_outside_clients_traceparent_is_honoured_and_fleet_trace_draws_it(
    nc: Client, start_worker: WorkerFactory, receiver: OtlpReceiver, tmp_path: Path,
    nats_url: str,
) -> None:
    await serve_tiny_llm(nc, start_worker, receiver)
    task = chat("traced-1", "hello there", max_tokens=6)
    headers = {"traceparent": f"00-{OUTSIDE_TRACE}-{OUTSIDE_SPAN}-01", "Nats-Msg-Id": "traced-1"}
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await nc.jetstream().publish(subjects.tasks(task.model), encode(task), headers=headers)
    events = await collector
    assert finished(events).status == "completed"
    accepted = next(e for e in events if isinstance(e, TaskAccepted))
    assert accepted.trace_id == OUTSIDE_TRACE

    spans = await trace_spans(nc, OUTSIDE_TRACE, has(*TEXT_SPANS))
    assert_text_tree(spans, parent_of_process=OUTSIDE_SPAN)
    await asyncio.to_thread(receiver.wait_for, lambda got: {
        (s["service"], s["name"]) for s in got.spans if s["trace_id"] == OUTSIDE_TRACE
    } >= {("fleet-worker", "process fleet.tasks.tiny-llm"), ("fleet-runner", "decode")}, 30)
    await asyncio.to_thread(receiver.wait_for, lambda got: {
        ("fleet-worker", "gen_ai.server.time_to_first_token"),
        ("fleet-worker", "gen_ai.server.time_per_output_token"),
        ("fleet-worker", "fleet.task.queue_wait"),
    } <= got.metrics, 30)

    chrome = tmp_path / "trace.json"
    drawn = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli", "trace", task.task_id, "--chrome", str(chrome),
        cwd=REPO, env={**os.environ, "FLEET_NATS_URL": nats_url},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await drawn.communicate()
    assert drawn.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0].startswith(f"trace {OUTSIDE_TRACE} · ")
    names = [n for n in TEXT_SPANS if n != "send fleet.out.{task_id}"]
    drawn_order = [next(i for i, line in enumerate(lines) if name in line) for name in names]
    assert drawn_order == sorted(drawn_order)  # the tree, parents first
    assert "└─ decode" in lines[drawn_order[-1]] and "█" in lines[drawn_order[-1]]
    assert not any("start runner" in line for line in lines)  # it ended before this task
    document = json.loads(chrome.read_text())
    complete = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= set(TEXT_SPANS)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)


async def test_a_chat_request_through_the_gateway_is_one_trace_rooted_in_its_http_span(
    nc: Client, start_worker: WorkerFactory, receiver: OtlpReceiver, tmp_path: Path,
    nats_url: str,
) -> None:
    from openai import AsyncOpenAI
    await serve_tiny_llm(nc, start_worker, receiver)
    data_dir = tmp_path / "gateway"
    data_dir.mkdir()
    gateway = GatewayProcess(nats_url, data_dir, otlp_env(receiver.endpoint))
    try:
        await gateway.listening()
        openai = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
        reply = await openai.chat.completions.create(
            model="tiny-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            temperature=0,
        )
        trace_id = await trace_id_of_task(TaskLog.of(nc.jetstream()), reply.id)
        assert trace_id is not None
        http = "POST /v1/chat/completions"
        spans = await trace_spans(nc, trace_id, has(http, "send fleet.tasks.tiny-llm", *TEXT_SPANS))
        named = by_name(spans)
        assert "parent_id" not in named[http] and named[http]["kind"] == "server"
        assert named[http]["attributes"]["http.response.status_code"] == 200
        send = named["send fleet.tasks.tiny-llm"]
        assert (send["parent_id"], send["kind"]) == (named[http]["span_id"], "producer")
        assert send["attributes"]["messaging.message.id"] == reply.id
        assert_text_tree(spans, parent_of_process=send["span_id"])
        assert await traces_naming(nc, reply.id) == {trace_id}

        # A client that brings its own trace context has the request join its trace.
        await openai.chat.completions.create(
            model="tiny-llm", messages=[{"role": "user", "content": "again"}], max_tokens=4,
            extra_headers={"traceparent": f"00-{OUTSIDE_TRACE}-{OUTSIDE_SPAN}-01"},
        )
        joined = by_name(await trace_spans(nc, OUTSIDE_TRACE, has(http, "decode")))
        assert joined[http]["parent_id"] == OUTSIDE_SPAN
    finally:
        gateway.stop()
    await asyncio.to_thread(receiver.wait_for, lambda got: {
        s["service"] for s in got.spans if s["trace_id"] == trace_id
    } >= {"fleet-gateway", "fleet-worker", "fleet-runner"}, 30)


async def traces_naming(nc: Client, task_id: str) -> set[str]:
    """Every trace in FLEET_TRACES with a span about this task."""
    js = nc.jetstream()
    info = await js.stream_info(subjects.TRACES_STREAM, subjects_filter="fleet.traces.>")
    found = set()
    for subject in info.state.subjects or {}:
        for span in await spans_of_trace(js, subject.rsplit(".", 1)[-1]):
            if task_id in (span.get("attributes") or {}).values():
                found.add(span["trace_id"])
    return found


async def test_an_image_task_from_fleet_submit_has_a_span_per_diffusion_step(
    nc: Client, start_worker: WorkerFactory, receiver: OtlpReceiver, tmp_path: Path,
    tiny_flux2_dir: Path, nats_url: str,
) -> None:
    worker = start_worker(models={"tiny-flux2": tiny_flux2_dir}, **otlp_env(receiver.endpoint))
    node = await wait_node(nc, worker.data_dir)
    task = ImageGeneration(
        task_id="img-traced", model="tiny-flux2", prompt="a lighthouse", size="64x64", steps=3,
    )
    (tmp_path / "task.json").write_bytes(encode(task))
    collector = asyncio.create_task(events_of(nc, task.task_id))
    submitted = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli", "submit", "--file", str(tmp_path / "task.json"),
        "--no-follow", cwd=REPO,
        env={**os.environ, "FLEET_NATS_URL": nats_url, **otlp_env(receiver.endpoint)},
    )
    assert await submitted.wait() == 0
    # Placed after the task was sent: the task waits for its runner to start.
    await place(nc.jetstream(), get_card("tiny-flux2"), node_id=node, slots=1)
    assert finished(await collector).status == "completed"

    trace_id = await trace_id_of_task(TaskLog.of(nc.jetstream()), task.task_id)
    assert trace_id is not None
    steps = [f"diffusion step {n}/3" for n in (1, 2, 3)]
    named = by_name(await trace_spans(nc, trace_id, has(
        "send fleet.tasks.tiny-flux2", "process fleet.tasks.tiny-flux2",
        "image_generation tiny-flux2", "put image", *steps,
    )))
    send, process = named["send fleet.tasks.tiny-flux2"], named["process fleet.tasks.tiny-flux2"]
    assert send["service"] == "fleet-submit" and "parent_id" not in send
    assert process["parent_id"] == send["span_id"]
    generation = named["image_generation tiny-flux2"]
    assert generation["parent_id"] == process["span_id"]
    assert all(named[step]["parent_id"] == generation["span_id"] for step in steps)
    assert named["put image"]["parent_id"] == process["span_id"]

    # The runner's start is a trace of its own, linked from the generation span; `fleet
    # trace` draws it as well because this task waited on it.
    drawn = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli", "trace", task.task_id, cwd=REPO,
        env={**os.environ, "FLEET_NATS_URL": nats_url}, stdout=asyncio.subprocess.PIPE,
    )
    lines = (await drawn.communicate())[0].decode().splitlines()
    assert drawn.returncode == 0
    start = next(i for i, line in enumerate(lines) if "start runner tiny-flux2" in line)
    assert "├─ load tiny-flux2" in lines[start + 1] and "└─ warm_up tiny-flux2" in lines[start + 2]
    await asyncio.to_thread(receiver.wait_for, lambda got: {
        (s["service"], s["name"]) for s in got.spans if s["trace_id"] == trace_id
    } >= {
        ("fleet-submit", "send fleet.tasks.tiny-flux2"),
        ("fleet-worker", "process fleet.tasks.tiny-flux2"),
        ("fleet-runner", "diffusion step 3/3"),
    }, 30)
