"""The priority classes, highest first, and the clamp every side agrees on (the gateway
stamps a request's class; workers pull by it: fleet.worker.priority)."""

from __future__ import annotations

from fleet.wire.tasks import Priority

CLASSES: tuple[Priority, ...] = ("interactive", "default", "batch")
RANK: dict[str, int] = {name: rank for rank, name in enumerate(CLASSES)}


def clamp(asked: Priority, ceiling: Priority) -> Priority:
    """The class a request gets: what it asked for, never above its tenant's ceiling."""
    return asked if RANK[asked] >= RANK[ceiling] else ceiling
