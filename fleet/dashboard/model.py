"""Pure pieces of the dashboard's feed: the recent-tasks table a task's events fold into, and
the fleet snapshot the browser draws. No I/O here, so each is a table test."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk

RECENT_TASKS = 1000
# Every runner state, in the order the machine walks them (fleet/wire/runners.py).
RUNNER_STATES = (
    "idle", "connecting", "connected", "loading", "loaded", "warming_up", "ready", "running",
    "shutting_down", "shutdown", "failed",
)


@dataclass
class TaskRow:
    id: str
    model: str = ""
    status: str = "running"
    reason: str | None = None
    node: str | None = None
    tokens: int = 0
    images: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    duration_s: float | None = None
    started_at: float = 0.0
    updated_at: float = 0.0
    tenant: str | None = None  # from FLEET_TENANTS; None: not sent through a gateway


def sees(row_tenant: str | None, tenant: str | None, sees_all: bool) -> bool:
    """Whether a tab may see a task: an operator (or an open gateway) sees every task, a
    tenant only its own; a task with no known owner is the operators' alone."""
    return sees_all or (row_tenant is not None and row_tenant == tenant)


@dataclass
class RecentTasks:
    """The last `limit` tasks seen on `fleet.out.>`, newest last; an old one falls off."""

    limit: int = RECENT_TASKS
    rows: OrderedDict[str, TaskRow] = field(default_factory=OrderedDict)

    def fold(self, event: OutputEvent) -> TaskRow:
        row = self.rows.get(event.task_id)
        if row is None:
            row = self.rows[event.task_id] = TaskRow(id=event.task_id, started_at=event.at)
            while len(self.rows) > self.limit:
                self.rows.popitem(last=False)
        row.updated_at = event.at
        if isinstance(event, TaskAccepted):
            row.model, row.node = event.model, event.node_id
        elif isinstance(event, TokenChunk):
            # By index, not by event: fleet.out.* also carries re-sent copies, events stored
            # out of order and a continuation's superseding ones (fleet.bus.task_log).
            row.tokens = max(row.tokens, event.next_index)
        elif event.type == "image":
            row.images += 1
        elif isinstance(event, TaskFinished):
            row.status = event.status
            row.reason = event.reason.value if event.reason else event.finish_reason
            row.node = event.node_id or row.node
            if event.stats is not None:
                row.ttft_s = event.stats.time_to_first_token_s
                row.tokens_per_s = event.stats.tokens_per_s
                row.duration_s = event.stats.total_s
            if event.usage is not None:
                row.tokens = event.usage.completion_tokens or row.tokens
        return row

    def listing(self, tenant: str | None = None, sees_all: bool = True) -> list[dict[str, Any]]:
        """The rows this viewer may see, newest first."""
        return [asdict(row) for row in reversed(self.rows.values())
                if sees(row.tenant, tenant, sees_all)]


def node_view(node: dict[str, Any], now: float) -> dict[str, Any]:
    """A node's heartbeat as the page shows it: the age of the beat in seconds added."""
    return {**node, "heartbeat_age_s": round(max(0.0, now - float(node.get("at", now))), 1)}


def snapshot(
    nodes: list[dict[str, Any]],
    instances: list[dict[str, Any]],
    runners: list[dict[str, Any]],
    queues: dict[str, dict[str, int]],
    now: float,
) -> dict[str, Any]:
    """The fleet as one JSON object, sorted so that an unchanged fleet compares equal."""
    return {
        "nodes": sorted((node_view(n, now) for n in nodes), key=lambda n: n["node_id"]),
        "instances": sorted(instances, key=lambda i: i["instance_id"]),
        "runners": sorted(runners, key=lambda r: r["runner_id"]),
        "queues": dict(sorted(queues.items())),
        "runner_states": list(RUNNER_STATES),
    }


def beats(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What each heartbeat changes and `changed` leaves out of a snapshot: the beat's time and
    the free memory, sent on their own (small) between fleet snapshots."""
    return {n["node_id"]: {"at": n.get("at", 0.0),
                           "memory_available_bytes": n.get("memory_available_bytes", 0)}
            for n in nodes}


def changed(previous: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    """Whether the browser needs the new snapshot; heartbeat ages alone do not count."""
    if previous is None:
        return True

    def stable(snap: dict[str, Any]) -> dict[str, Any]:
        return {**snap, "nodes": [{**n, "heartbeat_age_s": 0, "at": 0,
                                   "memory_available_bytes": 0} for n in snap["nodes"]]}

    return stable(previous) != stable(current)
