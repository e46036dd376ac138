"""A trace in the Chrome trace event format (JSON object form), which Perfetto and
chrome://tracing open: one process per service, each span a complete ("X") event, each span
event an instant ("i") event. Times are microseconds from the trace's first span.

Complete events on one thread must nest, so spans that overlap without nesting (two tasks in
one batch) go to separate threads ("lanes"). Pure: span records in, a dict out.
"""

from __future__ import annotations

from typing import Any

from fleet.trace.records import SpanRecord


def lanes(spans: list[SpanRecord]) -> dict[str, int]:
    """span id -> lane, first fit: a span joins the first lane where it nests in what is open."""
    open_ends: list[list[int]] = []  # per lane, the end times of the spans it has open
    assigned: dict[str, int] = {}
    for span in sorted(spans, key=lambda s: (s["start_ns"], -s["end_ns"])):
        for lane, ends in enumerate(open_ends):
            while ends and ends[-1] <= span["start_ns"]:
                ends.pop()
            if not ends or span["end_ns"] <= ends[-1]:
                ends.append(span["end_ns"])
                assigned[span["span_id"]] = lane
                break
        else:
            open_ends.append([span["end_ns"]])
            assigned[span["span_id"]] = len(open_ends) - 1
    return assigned


def chrome_trace(spans: list[SpanRecord]) -> dict[str, Any]:
    origin = min((span["start_ns"] for span in spans), default=0)
    services = sorted({span.get("service", "unknown") for span in spans})
    pids = {service: index + 1 for index, service in enumerate(services)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": service}}
        for service, pid in pids.items()
    ]
    for service, pid in pids.items():
        own = [span for span in spans if span.get("service", "unknown") == service]
        lane_of = lanes(own)
        for span in own:
            tid = lane_of[span["span_id"]] + 1
            args = {
                "trace_id": span["trace_id"],
                "span_id": span["span_id"],
                "kind": span.get("kind", "internal"),
                **span.get("attributes", {}),
            }
            if parent := span.get("parent_id"):
                args["parent_id"] = parent
            events.append({
                "name": span["name"],
                "cat": span.get("kind", "internal"),
                "ph": "X",
                "ts": (span["start_ns"] - origin) / 1000,
                "dur": max(0, span["end_ns"] - span["start_ns"]) / 1000,
                "pid": pid,
                "tid": tid,
                "args": args,
            })
            for event in span.get("events", ()):
                events.append({
                    "name": event["name"],
                    "ph": "i",
                    "s": "t",
                    "ts": (event["time_ns"] - origin) / 1000,
                    "pid": pid,
                    "tid": tid,
                    "args": event.get("attributes", {}),
                })
    return {"traceEvents": events, "displayTimeUnit": "ms"}
