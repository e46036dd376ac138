"""A task's spans leave in one message: held while their trace's local roots are open here
(fleet/trace/held.py), released with the last root's end or after HOLD_MAX_S."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from fleet.trace import nats_export
from fleet.trace.held import HOLD_MAX_S, HeldTraces
from fleet.trace.nats_export import NatsSpanProcessor, message_bodies
from fleet.wire.pipe import TraceSpans


def record(trace_id: str, name: str) -> dict[str, Any]:
    return {"trace_id": trace_id, "span_id": "0" * 15 + "1", "name": name}


def run(trace_id: str, *names: str) -> TraceSpans:
    """A runner's run of records, as its worker carries it: the JSON the runner wrote."""
    records = [record(trace_id, name) for name in names]
    return TraceSpans(trace_id, len(records), orjson.dumps(records)[1:-1])


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # (operation, trace, time) -> what each step returned: held? / released names
        ([("hold", "a", 0.0)], [False]),  # no root open here: sent with the next flush
        ([("open", "a", 0.0), ("hold", "a", 0.0), ("close", "a", 0.1)], [None, True, ["a0"]]),
        ([("open", "a", 0.0), ("open", "a", 0.0), ("hold", "a", 0.0), ("close", "a", 0.1),
          ("close", "a", 0.2)], [None, None, True, [], ["a0"]]),  # two roots: the last ends it
        ([("open", "a", 0.0), ("hold", "b", 0.0)], [None, False]),  # another trace
        ([("open", "a", 0.0), ("hold", "a", 0.0), ("due", "", HOLD_MAX_S - 0.01),
          ("due", "", HOLD_MAX_S), ("hold", "a", 2.0), ("close", "a", 2.0)],
         [None, True, [], ["a0"], False, []]),  # due: released, the trace held no more
    ],
)
def test_what_is_held_and_when_it_is_released(
    steps: list[tuple[str, str, float]], expected: list[Any]
) -> None:
    held = HeldTraces()
    got: list[Any] = []
    for operation, trace_id, now in steps:
        if operation == "open":
            got.append(held.opened(trace_id))
        elif operation == "hold":
            got.append(held.hold(record(trace_id, f"{trace_id}0"), now))
        elif operation == "close":
            got.append([r["name"] for r in held.closed(trace_id)])
        else:
            got.append([r["name"] for r in held.due(now)])
    assert got == expected
    assert held.count == sum(len(records) for records in held.held.values())


def test_a_runners_run_is_held_and_counted_as_its_records() -> None:
    held = HeldTraces()
    held.opened("a")
    assert held.hold(run("a", "generation", "prefill", "decode"), 0.0)
    assert held.hold(record("a", "send"), 0.0)
    assert held.count == 4
    assert held.closed("a") == [run("a", "generation", "prefill", "decode"), record("a", "send")]
    assert held.count == 0


def names_in(bodies: list[bytes]) -> list[list[str]]:
    return [[span["name"] for span in orjson.loads(body)["spans"]] for body in bodies]


@pytest.mark.parametrize(
    ("spans", "max_spans", "max_bytes", "expected"),
    [
        # this process's records (a..) and runners' runs (r..) of one trace, in their order
        ([record("t", "a1"), run("t", "r1", "r2"), record("t", "a2")], 200, 10**6,
         [["a1", "r1", "r2", "a2"]]),
        ([record("t", f"a{i}") for i in range(5)], 2, 10**6,
         [["a0", "a1"], ["a2", "a3"], ["a4"]]),
        ([run("t", "r1", "r2"), run("t", "r3", "r4"), record("t", "a1")], 3, 10**6,
         [["r1", "r2"], ["r3", "r4", "a1"]]),  # a run is never split
        ([run("t", "r1", "r2", "r3"), record("t", "a1")], 2, 10**6,
         [["r1", "r2", "r3"], ["a1"]]),  # one larger than a message goes alone
        ([run("t", "r1"), run("t", "r2"), run("t", "r3")], 200, 2 * len(run("t", "r1").body) + 2,
         [["r1", "r2"], ["r3"]]),  # bytes: each piece and its comma
        ([], 200, 10**6, []),
    ],
)
def test_a_traces_spans_make_message_bodies_within_the_limits(
    spans: list[Any], max_spans: int, max_bytes: int, expected: list[list[str]]
) -> None:
    assert names_in(message_bodies(spans, max_spans, max_bytes)) == expected


class FakeClient:
    """Only what the processor calls: the test is about which records travel together."""

    is_connected = True

    def __init__(self) -> None:
        self.published: list[tuple[str, list[str]]] = []
        self.sent = asyncio.Event()

    async def publish(self, subject: str, body: bytes) -> None:
        self.published.append((subject, [s["name"] for s in orjson.loads(body)["spans"]]))
        self.sent.set()


async def test_a_tasks_spans_and_its_runners_leave_in_one_message_when_its_root_ends() -> None:
    client = FakeClient()
    processor = NatsSpanProcessor(lambda: client)  # type: ignore[arg-type, return-value]
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    remote = SpanContext(trace_id=0xAB, span_id=0xCD, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    root = tracer.start_span("process", context=set_span_in_context(NonRecordingSpan(remote)))
    trace_id = format(0xAB, "032x")
    with tracer.start_as_current_span("send", context=set_span_in_context(root)):
        pass
    processor.add([run(trace_id, "generation", "prefill")])  # a runner's, re-exported
    await processor._flush(everything=False)
    assert client.published == []  # held while the root is open
    root.end()
    await processor._flush(everything=False)
    assert client.published == [
        (f"fleet.traces.{trace_id}", ["send", "generation", "prefill", "process"])]


async def test_a_span_ended_in_a_thread_is_held_with_its_root() -> None:
    """Only the loop's thread touches the processor's buffers: a span that ends in
    asyncio.to_thread is handed to the loop, and is there before the thread's result is."""
    client = FakeClient()
    processor = NatsSpanProcessor(lambda: client)  # type: ignore[arg-type, return-value]
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    root = tracer.start_span("process")

    def in_a_thread() -> None:
        with tracer.start_as_current_span("fetch inputs", context=set_span_in_context(root)):
            pass

    await asyncio.to_thread(in_a_thread)
    root.end()
    await processor._flush(everything=False)
    trace_id = format(root.get_span_context().trace_id, "032x")
    assert client.published == [(f"fleet.traces.{trace_id}", ["fetch inputs", "process"])]


async def test_past_max_buffered_a_runners_run_is_dropped_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nats_export, "MAX_BUFFERED", 3)
    client = FakeClient()
    processor = NatsSpanProcessor(lambda: client)  # type: ignore[arg-type, return-value]
    processor.add([run("a" * 32, "r1", "r2"), run("b" * 32, "r3", "r4"), record("c" * 32, "c")])
    assert processor.dropped == 2
    await processor.flush()
    assert sorted(names for _, names in client.published) == [["c"], ["r1", "r2"]]


async def test_flush_sends_what_is_held_too() -> None:
    client = FakeClient()
    processor = NatsSpanProcessor(lambda: client)  # type: ignore[arg-type, return-value]
    provider = TracerProvider()
    provider.add_span_processor(processor)
    root = provider.get_tracer("test").start_span("process")
    processor.add([record(format(root.get_span_context().trace_id, "032x"), "generation")])
    await processor.flush()  # before a connection closes
    assert [names for _, names in client.published] == [["generation"]]
    root.end()


@pytest.mark.parametrize("from_a_thread", [False, True])
async def test_records_added_go_out_by_the_flush_they_schedule(from_a_thread: bool) -> None:
    """The flush is the processor's own task, started in the loop's thread either way (a
    span may end in `asyncio.to_thread`)."""
    client = FakeClient()
    processor = NatsSpanProcessor(lambda: client)  # type: ignore[arg-type, return-value]
    records = [record("e" * 32, "ended")]
    if from_a_thread:
        await asyncio.to_thread(processor.add, records)
    else:
        processor.add(records)
    await asyncio.wait_for(client.sent.wait(), 5.0)
    assert client.published == [(f"fleet.traces.{'e' * 32}", ["ended"])]
