"""Waterfall and Chrome trace rendering: span records in, text and trace events out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleet.trace.render import bar, chrome_trace, label, lanes, tree_rows, waterfall

MS = 1_000_000
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def span(span_id: str, name: str, start: int, end: int, parent: str | None = None,
         service: str = "fleet-worker", **extra: Any) -> dict[str, Any]:
    record = {"trace_id": TRACE, "span_id": span_id, "name": name, "kind": "internal",
              "service": service, "start_ns": start * MS, "end_ns": end * MS, **extra}
    if parent:
        record["parent_id"] = parent
    return record


CHAT = [
    span("d", "decode", 40, 100, "c", "fleet-runner"),
    span("a", "POST /v1/chat/completions", 0, 100, service="fleet-gateway"),
    span("b", "send fleet.tasks.tiny-llm", 1, 2, "a", "fleet-gateway"),
    span("p", "process fleet.tasks.tiny-llm", 3, 99, "b",
         events=[{"name": "dispatch", "time_ns": 4 * MS}, {"name": "ack", "time_ns": 99 * MS}]),
    span("c", "chat tiny-llm", 5, 100, "p", "fleet-runner"),
    span("f", "prefill", 5, 40, "c", "fleet-runner"),
]


def test_the_tree_is_depth_first_with_children_by_start_time() -> None:
    assert [(row.prefix, row.span["name"]) for row in tree_rows(CHAT)] == [
        ("", "POST /v1/chat/completions"),
        ("└─ ", "send fleet.tasks.tiny-llm"),
        ("   └─ ", "process fleet.tasks.tiny-llm"),
        ("      └─ ", "chat tiny-llm"),
        ("         ├─ ", "prefill"),
        ("         └─ ", "decode"),
    ]


def test_a_span_whose_parent_is_elsewhere_is_a_root() -> None:
    outside = [span("p", "process fleet.tasks.m", 0, 10, "0123456789abcdef")]
    assert [row.prefix for row in tree_rows(outside)] == [""]


@pytest.mark.parametrize(
    ("record", "text"),
    [
        (CHAT[3], "process fleet.tasks.tiny-llm (ack)"),
        (span("x", "chat m", 0, 1, status="error", status_message="boom"), "chat m !boom"),
        (span("x", "chat m", 0, 1), "chat m"),
        # The attempt that lost the task to another, and the one that took it over.
        (span("x", "process fleet.tasks.m", 0, 1, events=[{"name": "fenced", "time_ns": 1}]),
         "process fleet.tasks.m (fenced)"),
        (span("x", "process fleet.tasks.m", 0, 1, events=[
            {"name": "seam", "time_ns": 1, "attributes": {
                "fleet.attempt": 1, "fleet.continued_from": 30, "fleet.moved_from": "node-a"}},
            {"name": "ack", "time_ns": 2}]),
         "process fleet.tasks.m (ack) [attempt 1 from token 30, moved from node-a]"),
    ],
)
def test_labels_show_the_settle_verb_and_errors(record: dict[str, Any], text: str) -> None:
    assert label(record) == text


@pytest.mark.parametrize(
    ("start", "end", "drawn"),
    [(0, 100, "█" * 10), (0, 1, "█"), (50, 60, " " * 5 + "█"), (99, 100, " " * 9 + "█")],
)
def test_bars_are_placed_in_proportion_and_never_vanish(start: int, end: int, drawn: str) -> None:
    assert bar(start, end, 0, 100, 10) == drawn


def test_the_waterfall_has_offsets_durations_names_services_and_bars() -> None:
    lines = waterfall(CHAT, bar_width=20)
    assert lines[0] == f"trace {TRACE} · 6 spans · 100.0 ms"
    decode = lines[-1]
    assert decode.split()[:2] == ["40.0", "60.0"]
    assert "└─ decode" in decode and "fleet-runner" in decode
    assert decode.endswith(" " * 8 + "█" * 12)


def test_lanes_keep_nesting_spans_together_and_part_overlapping_ones() -> None:
    batch = [
        span("a", "process 1", 0, 50),
        span("b", "fetch inputs", 1, 5, "a"),
        span("c", "process 2", 10, 60),  # overlaps "process 1" without nesting in it
        span("d", "put image", 55, 58, "c"),
    ]
    assert lanes(batch) == {"a": 0, "b": 0, "c": 1, "d": 0}


def test_the_chrome_trace_is_json_with_one_complete_event_per_span() -> None:
    document = json.loads(json.dumps(chrome_trace(CHAT)))
    events = document["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"fleet-gateway", "fleet-worker", "fleet-runner"}
    complete = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in complete) == sorted(s["name"] for s in CHAT)
    decode = next(e for e in complete if e["name"] == "decode")
    assert (decode["ts"], decode["dur"]) == (40_000.0, 60_000.0)
    assert decode["args"]["parent_id"] == "c"
    assert [e["name"] for e in events if e["ph"] == "i"] == ["dispatch", "ack"]
