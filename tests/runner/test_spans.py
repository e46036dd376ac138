"""The runner's spans, in-process: the state machine on the fault engine (a plumbing double),
spans written to the same report stream the pipe carries, read back as span records."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from fleet.runner.engine import EngineConfig
from fleet.runner.fault_engine import FaultEngine, fault_card
from fleet.runner.image_steps import StepTiming
from fleet.runner.machine import RunnerMachine
from fleet.runner.main import Inbox, serve
from fleet.runner.spans import RunnerSpans, SpanBuffer
from fleet.wire.events import TaskFinished
from fleet.wire.pipe import (
    ConnectToGroup,
    LoadModel,
    RunnerSpec,
    Shutdown,
    SpanBatch,
    SubmitTask,
    WarmUp,
)
from fleet.wire.tasks import ChatMessage, ImageGeneration, TextGeneration

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


SPEC = RunnerSpec(
    runner_id="run-1", instance_id="inst-1", node_id="node-a", card=fault_card(),
    model_path="/nowhere", images_dir="/tmp",
)


def runner_spans() -> RunnerSpans:
    buffer = SpanBuffer()
    provider = TracerProvider()
    provider.add_span_processor(buffer)
    return RunnerSpans(SPEC, buffer, provider)


def run_one_task(task: TextGeneration) -> list[Any]:
    """Bring a fault runner up, run `task`, shut down; every report, spans included."""
    reports: list[Any] = []
    spans = runner_spans()
    inbox: Inbox = queue.Queue()

    def emit(report: Any) -> None:  # the worker's side: shut down once the task is done
        reports.append(report)
        if isinstance(report, TaskFinished):
            inbox.put(Shutdown())

    config = EngineConfig(card=SPEC.card, model_path=Path("/nowhere"), slots=2, images_dir=Path())
    machine = RunnerMachine(SPEC, FaultEngine(config, sleep=lambda _: None), spans.observing(emit))
    submit = SubmitTask(task=task, traceparent=f"00-{TRACE}-{PARENT}-01")
    for command in (ConnectToGroup(), LoadModel(), WarmUp(), submit):
        inbox.put(command)
    assert serve(machine, inbox, observe=spans.on_command) == 0
    return reports


def records(reports: list[Any]) -> dict[str, dict[str, Any]]:
    found = [r for report in reports if isinstance(report, SpanBatch) for r in report.spans]
    return {record["name"]: record for record in found}


def test_a_chat_task_has_a_generation_span_under_the_worker_with_prefill_and_decode() -> None:
    task = TextGeneration(
        task_id="t1", model="fault-llm", max_tokens=16,
        messages=[ChatMessage(role="user", content="tokens:5")],
    )
    spans = records(run_one_task(task))

    generation = spans["chat fault-llm"]
    assert (generation["trace_id"], generation["parent_id"]) == (TRACE, PARENT)
    attributes = generation["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "fault-llm"
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert "gen_ai.server.time_to_first_token" in attributes
    for phase in ("prefill", "decode"):
        assert spans[phase]["parent_id"] == generation["span_id"]
    assert spans["prefill"]["end_ns"] == spans["decode"]["start_ns"]
    assert generation["start_ns"] <= spans["prefill"]["start_ns"]
    assert spans["decode"]["end_ns"] <= generation["end_ns"]
    assert spans["decode"]["attributes"]["gen_ai.usage.output_tokens"] == 5


def test_load_and_warm_up_are_their_own_trace_which_each_task_links_to() -> None:
    task = TextGeneration(task_id="t1", model="fault-llm", prompt="tokens:2")
    spans = records(run_one_task(task))

    start = spans["start runner fault-llm"]
    assert "parent_id" not in start and start["trace_id"] != TRACE
    assert spans["load fault-llm"]["parent_id"] == start["span_id"]
    assert spans["warm_up fault-llm"]["parent_id"] == start["span_id"]
    generation = spans["text_completion fault-llm"]
    assert generation["links"] == [{"trace_id": start["trace_id"], "span_id": start["span_id"]}]


def test_a_tasks_spans_follow_its_task_finished_in_one_batch() -> None:
    task = TextGeneration(task_id="t1", model="fault-llm", prompt="tokens:3")
    reports = run_one_task(task)
    finished_at = next(i for i, r in enumerate(reports) if isinstance(r, TaskFinished))
    batch = reports[finished_at + 1]
    assert isinstance(batch, SpanBatch)
    assert {record["trace_id"] for record in batch.spans} == {TRACE}
    assert len(batch.spans) == 3  # the generation, prefill, decode
    assert not any(
        record["trace_id"] == TRACE
        for report in reports[finished_at + 2 :] if isinstance(report, SpanBatch)
        for record in report.spans
    )


def test_diffusion_steps_become_spans_under_the_generation_span() -> None:
    reports: list[Any] = []
    spans = runner_spans()
    emit = spans.observing(reports.append)
    task = ImageGeneration(task_id="img-1", model="fault-llm", prompt="a cat", steps=2)
    spans.on_command(SubmitTask(task=task, traceparent=f"00-{TRACE}-{PARENT}-01"))
    base = time.time()
    for step in range(2):
        spans.on_step(StepTiming("img-1", 0, step, 2, base + step, base + step + 0.5))
    emit(TaskFinished(task_id="img-1", at=base + 3, status="completed"))

    got = records(reports)
    generation = got["image_generation fault-llm"]
    for name in ("diffusion step 1/2", "diffusion step 2/2"):
        assert got[name]["parent_id"] == generation["span_id"]
    step = got["diffusion step 2/2"]
    assert abs(step["end_ns"] - step["start_ns"] - 500_000_000) < 1000  # float seconds in


def test_a_task_whose_trace_is_not_sampled_has_no_spans_and_nothing_kept() -> None:
    """The parent's flag off (the SDK's default sampler): no record, and nothing of the task
    kept meanwhile, its diffusion steps included."""
    reports: list[Any] = []
    spans = runner_spans()
    emit = spans.observing(reports.append)
    task = ImageGeneration(task_id="img-1", model="fault-llm", prompt="a cat", steps=2)
    spans.on_command(SubmitTask(task=task, traceparent=f"00-{TRACE}-{PARENT}-00"))
    base = time.time()
    spans.on_step(StepTiming("img-1", 0, 0, 2, base, base + 0.5))
    emit(TaskFinished(task_id="img-1", at=base + 1, status="completed"))
    assert not [r for r in reports if isinstance(r, SpanBatch)]
    assert spans._tasks == {} and spans._steps.empty()


def test_deferred_the_spans_of_a_pass_leave_as_one_batch_after_it() -> None:
    """The runner's loop (`serve(..., passed=...)`): the spans of every task a step ended
    travel in one SpanBatch at the pass's end, not one a task."""
    reports: list[Any] = []
    spans = runner_spans()
    spans.deferred = True
    emit = spans.observing(reports.append)
    config = EngineConfig(card=SPEC.card, model_path=Path("/nowhere"), slots=4, images_dir=Path())
    machine = RunnerMachine(SPEC, FaultEngine(config, sleep=lambda _: None), emit)
    inbox: Inbox = queue.Queue()
    for command in (ConnectToGroup(), LoadModel(), WarmUp()):
        inbox.put(command)
    for i in range(3):
        inbox.put(SubmitTask(task=TextGeneration(task_id=f"t{i}", model="fault-llm",
                                                 prompt="tokens:1"),
                             traceparent=f"00-{TRACE}-{PARENT}-01"))

    def passed() -> None:
        spans.send(emit)
        if not machine.busy and any(isinstance(r, TaskFinished) for r in reports):
            inbox.put(Shutdown())

    assert serve(machine, inbox, observe=spans.on_command, passed=passed) == 0
    batches = [r for r in reports if isinstance(r, SpanBatch)]
    task_batches = [b for b in batches if {s["trace_id"] for s in b.spans} == {TRACE}]
    assert len(task_batches) == 1 and len(task_batches[0].spans) == 9  # 3 tasks x 3 spans
    last_finished = max(i for i, r in enumerate(reports) if isinstance(r, TaskFinished))
    assert reports.index(task_batches[0]) > last_finished
