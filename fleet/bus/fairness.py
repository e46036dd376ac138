"""Fair tenants within a priority class: the virtual token counter (VTC: Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024), as pure rules.

Each tenant of a (model, class) has a counter: the tokens served to it divided by its weight
(the keys file's `weight`, fleet.gateway.priority). The next task to start is the oldest of
the backlogged tenant whose counter is least (`next_tenant`); serving it adds its tokens
over its weight (`charge`). A tenant that was idle joins the backlog at the least counter of
those waiting (`lift`): it cannot bank credit while idle and then crowd the others out. Over
any busy period each backlogged tenant's tokens served stay within one task's tokens (over
its weight) of its weighted share: A sending 10x B's load gets no more than its weight.

The counters are plain numbers keyed by tenant, so they can live in a KV bucket and be kept
by compare-and-set from any gateway replica or worker; `holds` is the admission form of the
rule for a publisher that cannot reorder the broker's queue: it holds a tenant's task back
while that tenant is more than `quantum` tokens ahead of the least-served backlogged one.
Where the broker keeps each tenant's tasks apart (a worker's tenant lanes,
fleet.worker.lanes), `next_tenant` is applied as it stands: the worker pulls the next task
from the least-served lane.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping

from fleet.wire.fairness import CHARGED_HEADER

_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def tenant_token(tenant: str) -> str:
    """A tenant name as one KV key token (names outside [A-Za-z0-9_-] are base64url'd)."""
    if _SAFE.match(tenant):
        return tenant
    return "b64-" + base64.urlsafe_b64encode(tenant.encode()).decode().rstrip("=")


def charge(
    counters: Mapping[str, float], tenant: str, tokens: int, weight: float = 1.0
) -> dict[str, float]:
    """The counters after `tokens` were served to `tenant`."""
    return {**counters, tenant: counters.get(tenant, 0.0) + tokens / weight}


def lift(counters: Mapping[str, float], tenant: str, backlogged: Iterable[str]) -> dict[str, float]:
    """The counters when `tenant` joins the backlog: never below the least counter of the
    tenants already waiting (none waiting: as it was)."""
    waiting = [counters.get(t, 0.0) for t in backlogged if t != tenant]
    floor = min(waiting, default=counters.get(tenant, 0.0))
    return {**counters, tenant: max(counters.get(tenant, 0.0), floor)}


def next_tenant(counters: Mapping[str, float], backlogged: Iterable[str]) -> str | None:
    """The backlogged tenant served next: the least counter (ties: by name, for a stable
    order every replica computes alike)."""
    return min(backlogged, key=lambda t: (counters.get(t, 0.0), t), default=None)


def holds(
    counters: Mapping[str, float], tenant: str, backlogged: Iterable[str], quantum: float
) -> bool:
    """Whether a publisher holds `tenant`'s next task back: it is more than `quantum` ahead
    of the least-served tenant that is waiting too."""
    others = [counters.get(t, 0.0) for t in backlogged if t != tenant]
    return bool(others) and counters.get(tenant, 0.0) - min(others) > quantum


def shares(served: Mapping[str, int]) -> dict[str, float]:
    """Each tenant's fraction of the tokens served."""
    total = sum(served.values())
    return {t: (n / total if total else 0.0) for t, n in served.items()}


def charged_by_publisher(tenant: str | None) -> dict[str, str]:
    """The header a gateway sets on a tenant's task it charges itself (its fair turn), so
    the worker that ends the task does not charge it again (fleet.worker.fair_charge)."""
    return {} if tenant is None else {CHARGED_HEADER: "1"}
