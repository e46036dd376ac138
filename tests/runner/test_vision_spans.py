"""A vision task's `encode images` span: under its generation span, beside prefill, with how
many images it had and how many the vision cache held; a text task has none."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider

from fleet.runner.fault_engine import fault_card
from fleet.runner.spans import RunnerSpans, SpanBuffer
from fleet.runner.vision_cache import EncodeTiming
from fleet.wire.events import TaskFinished, TokenChunk, Usage
from fleet.wire.pipe import RunnerSpec, SpanBatch, SubmitTask
from fleet.wire.tasks import ChatMessage, ImagePart, TextGeneration, TextPart

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SPEC = RunnerSpec(runner_id="run-1", instance_id="inst-1", node_id="node-a", card=fault_card(),
                  model_path="/nowhere", images_dir="/tmp")


def spans_of(encode: bool) -> dict[str, dict[str, object]]:
    buffer = SpanBuffer()
    provider = TracerProvider()
    provider.add_span_processor(buffer)
    spans = RunnerSpans(SPEC, buffer, provider)
    task = TextGeneration(task_id="v1", model="fault-llm", max_tokens=2, messages=[
        ChatMessage(role="user", content=[ImagePart(sha256="a" * 64), TextPart(text="?")])])
    spans.on_command(SubmitTask(task=task, traceparent=f"00-{TRACE}-{PARENT}-01"))
    start = time.time()
    if encode:
        spans.on_encode(EncodeTiming("v1", start, start + 0.01, images=1, cached=1))
    sent: list[object] = []
    emit = spans.observing(sent.append)
    emit(TokenChunk(task_id="v1", at=start + 0.02, index=0, token_id=5, text="a"))
    emit(TaskFinished(task_id="v1", at=start + 0.03, status="completed", finish_reason="length",
                      usage=Usage(prompt_tokens=20, completion_tokens=2, total_tokens=22,
                                  images=1, cached_images=1)))
    found = [r for report in sent if isinstance(report, SpanBatch) for r in report.spans]
    return {record["name"]: record for record in found}


def test_a_vision_task_has_an_encode_span_beside_prefill() -> None:
    spans = spans_of(encode=True)
    generation, encode = spans["chat fault-llm"], spans["encode images"]
    assert encode["parent_id"] == generation["span_id"]
    assert encode["attributes"] == {"fleet.vision.images": 1, "fleet.vision.cached_images": 1}
    assert spans["prefill"]["start_ns"] <= encode["start_ns"] <= encode["end_ns"]  # type: ignore[operator]
    assert "encode images" not in spans_of(encode=False)
