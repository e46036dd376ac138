"""A trace's span records drawn two ways. Pure: records in, text or a dict out.

The terminal waterfall: the span tree with start offsets, durations and bars.

    start ms    dur ms  span                              service        0 ms ··· 812.3 ms
         0.0     812.3  POST /v1/chat/completions         fleet-gateway  ████████████████████
         1.2       0.8  └─ send fleet.tasks.tiny-llm      fleet-gateway  █
         ...

A span whose parent is not among the records (the trace came from an outside client, or a
parent is not stored yet) is drawn as a root.

The Chrome trace event format (JSON object form), which Perfetto and chrome://tracing open:
one process per service, each span a complete ("X") event, each span event an instant ("i")
event, times in microseconds from the trace's first span. Complete events on one thread must
nest, so spans that overlap without nesting (two tasks in one batch) go to separate threads
("lanes").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fleet.trace.records import SpanRecord

# How a worker let a message go: the JetStream verbs, and the two ways of giving a task up
# to another attempt without one (fleet.worker.takeover).
SETTLE_VERBS = ("ack", "nak", "term", "fenced", "superseded")
SEAM = "seam"  # a continued attempt's dispatch: fleet.attempt, .continued_from, .moved_from


@dataclass(frozen=True)
class Row:
    span: SpanRecord
    prefix: str  # the tree drawing in front of the name


def tree_rows(spans: list[SpanRecord]) -> list[Row]:
    """Depth first, children by start time."""
    ids = {span["span_id"] for span in spans}
    children: dict[str | None, list[SpanRecord]] = {}
    for span in spans:
        parent = span.get("parent_id")
        children.setdefault(parent if parent in ids else None, []).append(span)
    for siblings in children.values():
        siblings.sort(key=lambda span: (span["start_ns"], -span["end_ns"]))

    def walk(span: SpanRecord, lead: str, branch: str) -> Iterator[Row]:
        yield Row(span, lead + branch)
        below = children.get(span["span_id"], [])
        deeper = lead + {"": "", "├─ ": "│  ", "└─ ": "   "}[branch]
        for index, child in enumerate(below):
            yield from walk(child, deeper, "└─ " if index == len(below) - 1 else "├─ ")

    rows: list[Row] = []
    for root in children.get(None, []):
        rows.extend(walk(root, "", ""))
    return rows


def label(span: SpanRecord) -> str:
    """The span's name, with how its message was settled and whether it failed."""
    text = span["name"]
    verbs = [e["name"] for e in span.get("events", ()) if e["name"] in SETTLE_VERBS]
    if verbs:
        text += f" ({', '.join(verbs)})"
    if seam := next((e for e in span.get("events", ()) if e["name"] == SEAM), None):
        text += " " + seam_label(seam.get("attributes") or {})
    if span.get("status") == "error":
        text += " !" + (span.get("status_message") or "error")[:40]
    return text


def seam_label(attributes: dict[str, Any]) -> str:
    """Where a continued attempt took over: `[attempt 1 from token 30, moved from node-a]`."""
    attempt = attributes.get("fleet.attempt", "?")
    token = attributes.get("fleet.continued_from", "?")
    moved = attributes.get("fleet.moved_from") or "?"
    return f"[attempt {attempt} from token {token}, moved from {moved}]"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def bar(start: int, end: int, origin: int, total: int, width: int) -> str:
    """At least one cell, so that a span of microseconds is still seen."""
    first = min(width - 1, int((start - origin) / total * width))
    cells = max(1, round((end - start) / total * width))
    return " " * first + "█" * min(cells, width - first)


def waterfall(
    spans: list[SpanRecord], bar_width: int = 40, name_width: int = 44
) -> list[str]:
    if not spans:
        return []
    origin = min(span["start_ns"] for span in spans)
    finish = max(span["end_ns"] for span in spans)
    total = max(finish - origin, 1)
    services = max(len(span.get("service", "")) for span in spans)
    traces = sorted({span["trace_id"] for span in spans})
    lines = [
        f"trace {', '.join(traces)} · {len(spans)} spans · {total / 1e6:.1f} ms",
        f"{'start ms':>10} {'dur ms':>9}  {'span':<{name_width}}  {'service':<{services}}  "
        f"0 ms{'':·<{max(0, bar_width - 14)}}{total / 1e6:>8.1f} ms",
    ]
    for row in tree_rows(spans):
        span = row.span
        start, end = span["start_ns"], max(span["end_ns"], span["start_ns"])
        name = _cut(row.prefix + label(span), name_width)
        lines.append(
            f"{(start - origin) / 1e6:>10.1f} {(end - start) / 1e6:>9.1f}  {name:<{name_width}}  "
            f"{span.get('service', ''):<{services}}  {bar(start, end, origin, total, bar_width)}"
        )
    return lines


# ---- Chrome trace events --------------------------------------------------------------


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
