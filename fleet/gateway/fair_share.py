"""Fair tenants, applied where a task enters the queue: the gateway holds back a tenant's
task while that tenant is more than QUANTUM virtual tokens ahead of the least-served tenant
with requests waiting in the same (model, class) (fleet.bus.fairness: `holds`, `lift`,
`charge`), and charges what each task served when its request ends.

Why at admission: a class's tasks share one JetStream pull consumer, which hands them out in
publish order; a worker cannot reorder it without naks that spend the tasks' deliveries.
Holding the flooding tenant's next publish leaves the queue to the others' tasks, so they are
served next; the held task is published as soon as the others catch up (or stop waiting).

The counters live in KV FLEET_FAIRNESS (fleet.wire.fairness.TenantShare), updated by
compare-and-set, so every gateway replica applies the same rule. A tenant's `waiting` counts
its requests admitted and not ended; an entry unchanged for STALE_S (a gateway died mid-
request, or one task runs long) counts as not waiting, so nobody is held behind it for ever.
A hold also ends after HOLD_MAX_S: fairness shapes the order, it never fails a request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.fairness import charge, holds, lift
from fleet.wire.fairness import TenantShare

log = logging.getLogger(__name__)

BUCKET = "FLEET_FAIRNESS"
QUANTUM = 512.0  # virtual tokens a tenant may run ahead of the least-served waiting one
STALE_S = 60.0
HOLD_MAX_S = 120.0
RECHECK_S = 1.0  # a held request re-reads the counters at least this often (staleness)
_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def tenant_token(tenant: str) -> str:
    """A tenant name as one KV key token (names outside [A-Za-z0-9_-] are base64url'd)."""
    if _SAFE.match(tenant):
        return tenant
    return "b64-" + base64.urlsafe_b64encode(tenant.encode()).decode().rstrip("=")


def backlogged(shares: dict[str, TenantShare], now: float) -> list[str]:
    """The tenants with requests waiting (pure): a stale entry waits no more."""
    return [t for t, s in shares.items() if s.waiting > 0 and now - s.at < STALE_S]


class View:
    """One (model, class)'s entries as this replica last saw them: loaded once by a watch
    (one short-lived consumer), then kept by a core subscription to the bucket's subjects
    (KV puts are published there), so a held request costs the server no consumer."""

    def __init__(self) -> None:
        self.shares: dict[str, TenantShare] = {}
        self.changed = asyncio.Event()  # replaced after each change: waiters hold the old one
        self.sub: Subscription | None = None

    def see(self, tenant: str, data: bytes) -> None:
        if data:
            self.shares[tenant] = TenantShare.model_validate_json(data)
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class FairShare:
    def __init__(self, nc: Client, kv: KeyValue, quantum: float | None = None) -> None:
        self.nc = nc
        self.kv = kv
        self.quantum = QUANTUM if quantum is None else quantum
        self.views: dict[str, View] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    async def _view(self, prefix: str) -> View:
        if (view := self.views.get(prefix)) is not None:
            return view
        async with self._opening.setdefault(prefix, asyncio.Lock()):
            if (view := self.views.get(prefix)) is not None:
                return view
            view = View()

            async def on_put(msg: Msg) -> None:
                view.see(msg.subject.rsplit(".", 1)[1], msg.data)

            # Subscribed before loading, so no change falls between the two.
            view.sub = await self.nc.subscribe(f"$KV.{BUCKET}.{prefix}.*", cb=on_put)
            watcher = await self.kv.watch(f"{prefix}.*", ignore_deletes=True)
            try:
                async for entry in watcher:
                    if entry is None:  # the initial values are done
                        break
                    if entry.value:
                        view.shares.setdefault(entry.key.rsplit(".", 1)[1],
                                               TenantShare.model_validate_json(entry.value))
            finally:
                await watcher.stop()
            self.views[prefix] = view
            return view

    async def close(self) -> None:
        for view in self.views.values():
            if view.sub is not None:
                with contextlib.suppress(Exception):
                    await view.sub.unsubscribe()
        self.views.clear()

    async def _change(self, prefix: str, tenant: str, change: str, tokens: float = 0.0,
                      weight: float = 1.0, force: bool = False) -> bool:
        """Compare-and-set one tenant's entry; False only for a `start` that must wait.
        `join`: waiting + 1, lifted to the least waiting counter when it was idle.
        `start`: unless the tenant is held, charge the request's estimate now, so the
        tenant's other held requests see it at once (they all set this one key, so only one
        of them passes on the same reading).
        `leave`: waiting - 1, charged `tokens` (what it served less the estimate)."""
        view = await self._view(prefix)
        key = f"{prefix}.{tenant}"
        while True:
            try:
                entry = await self.kv.get(key)
                revision: int | None = entry.revision
                mine = TenantShare.model_validate_json(entry.value or b"")
            except KeyNotFoundError:
                revision, mine = None, TenantShare(counter=0.0, waiting=0, at=0.0)
            shares = {**view.shares, tenant: mine}
            now = time.time()
            counters = {t: share.counter for t, share in shares.items()}
            waiting = backlogged(shares, now)
            if change == "join":
                fresh = tenant in waiting
                new = TenantShare(
                    counter=mine.counter if fresh else lift(counters, tenant, waiting)[tenant],
                    waiting=(mine.waiting if fresh else 0) + 1, at=now)
            elif change == "start":
                if not force and holds(counters, tenant, [*waiting, tenant], self.quantum):
                    return False
                new = mine.model_copy(update={"at": now, "counter": charge(
                    counters, tenant, int(tokens), weight)[tenant]})
            else:
                counter = max(0.0, mine.counter + tokens / weight)
                new = TenantShare(counter=counter, waiting=max(0, mine.waiting - 1), at=now)
            if await self._set(key, new, revision):
                view.shares[tenant] = new  # at once: the subscription's copy comes later
                return True

    async def _set(self, key: str, new: TenantShare, revision: int | None) -> bool:
        """Write `new` unless the key changed since `revision` (then False: read again)."""
        data = new.model_dump_json().encode()
        try:
            if revision is None:
                await self.kv.create(key, data)
            else:
                await self.kv.update(key, data, last=revision)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def _start(self, prefix: str, tenant: str, estimate: int, weight: float) -> None:
        """Until `tenant` is not ahead of the others waiting, then its estimate charged: woken
        by any change of the (model, class) counters, re-reading at least every RECHECK_S."""
        deadline = time.monotonic() + HOLD_MAX_S
        view = await self._view(prefix)
        while True:
            changed = view.changed
            if await self._change(prefix, tenant, "start", estimate, weight):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                log.info("fair share: %s held %.0f s, released", prefix, HOLD_MAX_S)
                await self._change(prefix, tenant, "start", estimate, weight, force=True)
                return
            # nothing changed within RECHECK_S: re-read anyway, for entries gone stale
            await set_within(changed, min(RECHECK_S, left))

    async def admit(
        self, model: str, priority: str, tenant: str, weight: float, estimate: int
    ) -> Ticket:
        """Wait until `tenant`'s turn in (model, class), charging `estimate` tokens (what the
        request may serve); the ticket corrects that when the request ends. NATS trouble
        makes it unfair, never failed: logged, and the request goes on."""
        prefix = f"{model}.{priority}"
        token = tenant_token(tenant)
        try:
            await self._change(prefix, token, "join")
        except Exception as exc:
            log.warning("fair share of %s in %s not applied: %s", tenant, prefix, exc)
            return Ticket(None, prefix, token, weight, 0)
        ticket = Ticket(self, prefix, token, weight, 0)
        try:
            await self._start(prefix, token, estimate, weight)
            ticket.estimate = estimate
        except Exception as exc:
            log.warning("fair share of %s in %s not waited for: %s", tenant, prefix, exc)
        except BaseException:
            await ticket.settle(0)
            raise
        return ticket


class Ticket:
    """One admitted request: `settle` (once; later calls do nothing) charges what it served
    less what was charged when it started."""

    def __init__(self, fair: FairShare | None, prefix: str, tenant: str, weight: float,
                 estimate: int) -> None:
        self.fair, self.prefix, self.tenant = fair, prefix, tenant
        self.weight, self.estimate = weight, estimate

    async def settle(self, tokens: int) -> None:
        fair, self.fair = self.fair, None
        if fair is None:
            return
        try:
            await asyncio.shield(fair._change(
                self.prefix, self.tenant, "leave", tokens - self.estimate, self.weight))
        except Exception as exc:
            log.warning("fair share of %s in %s not charged: %s", self.tenant, self.prefix, exc)
