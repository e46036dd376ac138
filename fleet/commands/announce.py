"""`fleet up` tells the operator when each runner is ready (or failed), and how a model's
download from the fleet goes (a bar every 10%), from FLEET_RUNNERS; a standalone `fleet
worker` tells the same of its own node's runners, from its own records (its memory)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Iterable
from typing import TextIO

from fleet.bus.connect import connect_with
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import DecodeError, decode_model
from fleet.wire.runners import RunnerDownloading, RunnerFailed, RunnerStatus

log = logging.getLogger(__name__)

# The states worth a line: a runner that can take tasks, and one that never will.
NEWS = ("ready", "failed")
BAR_WIDTH = 20
PROGRESS_STEP = 10  # percent of a download between two lines
OWN_NEWS_PERIOD_S = 0.5  # how often a worker's console looks at its own runners


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """`[######--------------]  30% 162/540 MB`. Pure."""
    fraction = min(1.0, done / total) if total > 0 else 1.0
    filled = round(fraction * width)
    return (f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}% "
            f"{done / 1e6:.0f}/{total / 1e6:.0f} MB")


def status_text(status: RunnerStatus) -> str:
    """A runner's state for a listing, with its download progress when it has one and why
    when it failed (a fetch that failed says so rather than stay at its last progress). Pure."""
    if isinstance(status, RunnerDownloading):
        return f"downloading {progress_bar(status.bytes_done, status.bytes_total)}"
    if isinstance(status, RunnerFailed):
        return f"failed: {status.error}"
    return status.state


def runner_news(record: RunnerRecord, told: dict[str, str], who: str = "fleet up") -> str | None:
    """A line when `record` moves its runner into a state not told yet; `told` (runner id →
    last state told) is updated. `running` counts as ready: a runner busy at once is ready.
    A download gets a line at its start and then every PROGRESS_STEP percent."""
    status = record.status
    if isinstance(status, RunnerDownloading):
        total = status.bytes_total
        step = 100 if total <= 0 else status.bytes_done * 100 // total // PROGRESS_STEP
        key = f"downloading:{step}"
        if told.get(record.runner_id) == key:
            return None
        told[record.runner_id] = key
        return (f"{who}: node {record.node_id} fetching {record.model} from the fleet "
                f"{progress_bar(status.bytes_done, total)}")
    state = "ready" if status.state == "running" else status.state
    if state not in NEWS or told.get(record.runner_id) == state:
        return None
    told[record.runner_id] = state
    where = f"runner {record.runner_id} for {record.model} on node {record.node_id}"
    if state == "failed":
        return f"{who}: {where} failed: {getattr(record.status, 'error', '')}"
    return f"{who}: {where} is ready"


async def announce_own_runners(
    records: Callable[[], Iterable[RunnerRecord]], out: TextIO = sys.stderr,
    who: str = "fleet worker",
) -> None:
    """Print the news of a worker's own runners, read from its records every
    OWN_NEWS_PERIOD_S, until cancelled. It watched FLEET_RUNNERS on a connection of its own
    and kept its node's records: every node re-puts its runners' records each heartbeat, so
    a worker decoded N/3 records a second to print a few lines (`fleet bench --only scale`,
    N = 1,000 idle: the worker at 5.4 % of a core, 1.8 % at N = 10; py-spy put the rest of
    its time in its heartbeat and reads). Its own records are this process's: none is a
    predecessor's."""
    told: dict[str, str] = {}
    while True:
        for record in list(records()):
            if line := runner_news(record, told, who):
                print(line, file=out, flush=True)
        await asyncio.sleep(OWN_NEWS_PERIOD_S)  # the console's refresh, not a wait on anything


async def announce_runners(
    settings: Settings, out: TextIO = sys.stderr, who: str = "fleet up",
) -> None:
    """Print the news of every runner of the fleet until cancelled (the owner cancels it
    when the stack stops)."""
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
            if line := runner_news(record, told, who):
                print(line, file=out, flush=True)
    finally:
        await nc.close()
