"""A request's priority class and its tenant's share, from the `Fleet-Priority` header and
the tenant records (the keys file lines, fleet.gateway.keys):

    {"tenant": "team-a", "sha256": "...", "max_priority": "default", "weight": 2}

`max_priority` is the highest class the tenant's requests get (a request asking for more is
clamped to it, not refused); `weight` is its share of tokens served within a class (fleet.bus.
fairness). Without them a tenant may ask for any class and weighs 1. A request without the
header is `default`; a batch job's lines are `batch` (fleet.gateway.batch_tasks). On an open
gateway (no keys) every request may ask for any class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from starlette.requests import Request

from fleet.errors import InvalidParameter, InvalidRequest
from fleet.priorities import CLASSES, clamp
from fleet.wire.tasks import Priority, Task

HEADER = "fleet-priority"


@dataclass(frozen=True)
class TenantPolicy:
    max_priority: Priority = "interactive"
    weight: float = 1.0


OPEN = TenantPolicy()


def policy_of_line(entry: Mapping[str, Any], where: str) -> TenantPolicy:
    """The policy fields of one keys-file line (pure); a bad value names its line."""
    ceiling = entry.get("max_priority", "interactive")
    weight = entry.get("weight", 1.0)
    if ceiling not in CLASSES:
        raise InvalidRequest(f"{where}: max_priority is one of {', '.join(CLASSES)}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise InvalidRequest(f"{where}: weight is a number above 0")
    return TenantPolicy(cast(Priority, ceiling), float(weight))


def asked_priority(header: str | None) -> Priority:
    """The class a request asks for (pure): its header, or `default` without one."""
    if header is None or not header.strip():
        return "default"
    asked = header.strip().lower()
    if asked not in CLASSES:
        raise InvalidParameter(
            f"Fleet-Priority: one of {', '.join(CLASSES)}, not {header.strip()!r}", "priority")
    return cast(Priority, asked)


def priority_of(request: Request) -> Priority:
    policy = request.scope.get("state", {}).get("policy") or OPEN
    return clamp(asked_priority(request.headers.get(HEADER)), policy.max_priority)


def stamped(tasks: Sequence[Task], priority: Priority, tenant: str | None) -> list[Task]:
    return [task.model_copy(update={"priority": priority, "tenant": tenant}) for task in tasks]
