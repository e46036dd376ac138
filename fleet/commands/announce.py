"""`fleet up` tells the operator when each runner is ready (or failed), from FLEET_RUNNERS."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from fleet.bus.connect import connect_with
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import DecodeError, decode_model

log = logging.getLogger(__name__)

# The states worth a line: a runner that can take tasks, and one that never will.
NEWS = ("ready", "failed")


def runner_news(record: RunnerRecord, told: dict[str, str]) -> str | None:
    """A line when `record` moves its runner into a state not told yet; `told` (runner id →
    last state told) is updated. `running` counts as ready: a runner busy at once is ready."""
    state = "ready" if record.status.state == "running" else record.status.state
    if state not in NEWS or told.get(record.runner_id) == state:
        return None
    told[record.runner_id] = state
    where = f"runner {record.runner_id} for {record.model} on node {record.node_id}"
    if state == "failed":
        return f"fleet up: {where} failed: {getattr(record.status, 'error', '')}"
    return f"fleet up: {where} is ready"


async def announce_runners(settings: Settings, out: TextIO = sys.stderr) -> None:
    """Print runner news until cancelled (the owner cancels it when the stack stops)."""
    nc = await connect_with(settings, "fleet-up-runners")
    try:
        kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
        watcher = await kv.watchall()
        told: dict[str, str] = {}
        async for entry in watcher:
            if entry is None or not entry.value:
                continue
            try:
                record = decode_model(RunnerRecord, entry.value)
            except DecodeError as exc:
                log.warning("FLEET_RUNNERS %s: %s", entry.key, exc)
                continue
            if line := runner_news(record, told):
                print(line, file=out, flush=True)
    finally:
        await nc.close()
