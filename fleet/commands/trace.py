"""`fleet trace <task_id> [--chrome FILE]`: a task's trace as a waterfall, from JetStream
alone (the reading is fleet/trace/lookup.py)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
from pathlib import Path
from typing import Any

import orjson

from fleet.bus.connect import connect_with
from fleet.bus.task_log import TaskLog
from fleet.config import Settings, settings_of
from fleet.errors import FleetError
from fleet.trace.lookup import is_trace_id, linked_spans, spans_of_trace, trace_id_of_request
from fleet.trace.records import SpanRecord
from fleet.trace.render import chrome_trace, waterfall

LOOKUP_BUDGET_S = 5.0  # each read of the task's events waits out an election, not an outage


async def load_trace(settings: Settings, task_or_trace: str) -> tuple[str, list[SpanRecord]]:
    """The trace's id and its spans, plus those of linked traces that overlap it."""
    nc = await connect_with(settings, "fleet-trace")
    try:
        js = nc.jetstream()
        trace_id = task_or_trace if is_trace_id(task_or_trace) else None
        log = TaskLog.of(js, budget_s=LOOKUP_BUDGET_S)
        trace_id = trace_id or await trace_id_of_request(log, task_or_trace)
        if trace_id is None:
            raise FleetError(f"no trace found for task {task_or_trace}: unknown, or expired")
        spans = await spans_of_trace(js, trace_id)
        if spans:
            spans += await linked_spans(js, spans, min(span["start_ns"] for span in spans))
    finally:
        await nc.close()
    return trace_id, spans


def cmd_trace(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    trace_id, spans = asyncio.run(load_trace(settings, args.task_id))
    if not spans:
        raise FleetError(f"trace {trace_id} has no spans in FLEET_TRACES (expired, or disabled)")
    columns = shutil.get_terminal_size((140, 40)).columns
    bar_width = max(20, min(60, columns - 100))
    for line in waterfall(spans, bar_width=bar_width):
        print(line)
    if args.chrome:
        document: dict[str, Any] = chrome_trace(spans)
        Path(args.chrome).write_bytes(orjson.dumps(document))
        print(f"wrote {args.chrome}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace", help="a task's trace as a waterfall (spans stored in FLEET_TRACES)"
    )
    parser.add_argument("task_id", help="a task id, or a trace id (32 hex digits)")
    parser.add_argument("--chrome", type=Path, help="also write Chrome trace JSON here (Perfetto)")
    parser.set_defaults(func=cmd_trace)
