"""How many requests may wait on task events at once, per tenant and in all.

A waiting request costs the gateway a listener and a little memory, never a broker resource,
but an unbounded number of them is still a way to exhaust it. Over a limit the answer is 429
with Retry-After, so clients back off; 503 is kept for a broker that is really unreachable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from fleet.errors import AtCapacity


def refusal(waiting: int, mine: int, max_waiting: int, per_key: int) -> str | None:
    """Why one more waiting request is refused, or None (pure: table-tested)."""
    if mine >= per_key:
        return f"this API key already has {mine} requests waiting on task events (the limit)"
    if waiting >= max_waiting:
        return f"the gateway has {waiting} requests waiting on task events (its limit)"
    return None


class Capacity:
    def __init__(self, max_waiting: int, per_key: int) -> None:
        self.max_waiting = max_waiting
        self.per_key = per_key
        self.by_tenant: Counter[str] = Counter()

    @property
    def waiting(self) -> int:
        return self.by_tenant.total()

    def take(self, tenant: str | None) -> str:
        """Count one more waiting request of `tenant`. On an open gateway (tenant None) there
        are no keys to tell clients apart: only the limit in all applies."""
        who = tenant or ""
        mine = self.by_tenant[who] if tenant is not None else 0
        if why := refusal(self.waiting, mine, self.max_waiting, self.per_key):
            raise AtCapacity(why + "; retry later")
        self.by_tenant[who] += 1
        return who

    def give_back(self, who: str) -> None:
        self.by_tenant[who] -= 1
        if self.by_tenant[who] <= 0:
            del self.by_tenant[who]

    @contextmanager
    def slot(self, tenant: str | None) -> Iterator[None]:
        who = self.take(tenant)
        try:
            yield
        finally:
            self.give_back(who)
