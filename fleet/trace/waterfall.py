"""A trace as a terminal waterfall: the span tree with start offsets, durations and bars.

    start ms    dur ms  span                              service        0 ms ··· 812.3 ms
         0.0     812.3  POST /v1/chat/completions         fleet-gateway  ████████████████████
         1.2       0.8  └─ send fleet.tasks.tiny-llm      fleet-gateway  █
         ...

Pure: span records in, lines out. A span whose parent is not among the records (the trace
came from an outside client, or a parent is not stored yet) is drawn as a root.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fleet.trace.records import SpanRecord

SETTLE_VERBS = ("ack", "nak", "term")


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
    if span.get("status") == "error":
        text += " !" + (span.get("status_message") or "error")[:40]
    return text


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
