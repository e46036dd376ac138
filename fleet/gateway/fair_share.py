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

A batch line is admitted under a key, its task id: the entry marks it `charged` (with its
estimate) by the write that charges it, and `settled` by the write that charges what it
served, until its job has recorded its result (`forget`). A replica that took the job over
and runs the line again finds the mark, so it neither holds nor charges the line a second
time (before, a takeover charged each line it ran again twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.fairness import charge, holds, lift, tenant_token
from fleet.wire.fairness import TenantShare

log = logging.getLogger(__name__)

BUCKET = "FLEET_FAIRNESS"
QUANTUM = 512.0  # virtual tokens a tenant may run ahead of the least-served waiting one
STALE_S = 60.0
HOLD_MAX_S = 120.0
RECHECK_S = 1.0  # a held request re-reads the counters at least this often (staleness)
CHARGED_MAX = 4096  # batch lines a tenant's entry marks as started (64 a job in flight)
SETTLED_MAX = 256  # settled lines awaiting their recorded result (normally a few)


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
                      weight: float = 1.0, force: bool = False, key: str | None = None,
                      estimate: int = 0) -> bool:
        """Compare-and-set one tenant's entry; False for a `start` that must wait, or a keyed
        `join` whose request was admitted already (by a replica that ran its batch job).
        `join`: waiting + 1, lifted to the least waiting counter when it was idle.
        `start`: unless the tenant is held, charge the request's estimate now, so the
        tenant's other held requests see it at once (they all set this one key, so only one
        of them passes on the same reading).
        `leave`: waiting - 1, charged `tokens` served less what its start charged.
        `forget`: a keyed request's result is recorded; its `settled` mark goes.
        A `key` (a batch line's task id) makes each step happen once per key, whoever runs
        the line: the marks are in the entry the counter is, set by the same write."""
        view = await self._view(prefix)
        entry_key = f"{prefix}.{tenant}"
        while True:
            try:
                entry = await self.kv.get(entry_key)
                revision: int | None = entry.revision
                mine = TenantShare.model_validate_json(entry.value or b"")
            except KeyNotFoundError:
                revision, mine = None, TenantShare(counter=0.0, waiting=0, at=0.0)
            if key is not None and (done := keyed_done(mine, change, key)) is not None:
                return done
            shares = {**view.shares, tenant: mine}
            now = time.time()
            counters = {t: share.counter for t, share in shares.items()}
            waiting = backlogged(shares, now)
            if change == "join":
                fresh = tenant in waiting
                new = TenantShare(
                    counter=mine.counter if fresh else lift(counters, tenant, waiting)[tenant],
                    waiting=(mine.waiting if fresh else 0) + 1, at=now,
                    charged=mine.charged, settled=mine.settled, weight=mine.weight)
            elif change == "start":
                if not force and holds(counters, tenant, [*waiting, tenant], self.quantum):
                    return False
                new = mine.model_copy(update={"at": now, "counter": charge(
                    counters, tenant, int(tokens), weight)[tenant]})
                if key is not None:
                    new = new.model_copy(update={"charged": _bounded(
                        {**mine.charged, key: int(tokens)})})
            elif change == "forget":
                new = mine.model_copy(update={
                    "settled": [k for k in mine.settled if k != key]})
            else:
                if key is not None:
                    estimate = mine.charged[key]
                counter = max(0.0, mine.counter + (tokens - estimate) / weight)
                new = mine.model_copy(update={
                    "counter": counter, "waiting": max(0, mine.waiting - 1), "at": now})
                if key is not None:
                    new = new.model_copy(update={
                        "charged": {k: v for k, v in mine.charged.items() if k != key},
                        "settled": [*mine.settled, key][-SETTLED_MAX:]})
            if change != "forget":  # the weight a worker divides NATS tasks' tokens by
                new = new.model_copy(update={"weight": weight})
            if await self._set(entry_key, new, revision):
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

    async def _start(self, prefix: str, tenant: str, estimate: int, weight: float,
                     key: str | None = None) -> None:
        """Until `tenant` is not ahead of the others waiting, then its estimate charged: woken
        by any change of the (model, class) counters, re-reading at least every RECHECK_S."""
        deadline = time.monotonic() + HOLD_MAX_S
        view = await self._view(prefix)
        while True:
            changed = view.changed
            if await self._change(prefix, tenant, "start", estimate, weight, key=key):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                log.info("fair share: %s held %.0f s, released", prefix, HOLD_MAX_S)
                await self._change(prefix, tenant, "start", estimate, weight, force=True,
                                   key=key)
                return
            # nothing changed within RECHECK_S: re-read anyway, for entries gone stale
            await set_within(changed, min(RECHECK_S, left))

    async def admit(
        self, model: str, priority: str, tenant: str, weight: float, estimate: int,
        key: str | None = None,
    ) -> Ticket:
        """Wait until `tenant`'s turn in (model, class), charging `estimate` tokens (what the
        request may serve); the ticket corrects that when the request ends. With a `key` (a
        batch line's task id) a request already admitted under it (by the replica that ran
        its job before) is neither held nor charged again. NATS trouble makes it unfair,
        never failed: logged, and the request goes on."""
        prefix = f"{model}.{priority}"
        token = tenant_token(tenant)
        try:
            joined = await self._change(prefix, token, "join", weight=weight, key=key)
        except Exception as exc:
            log.warning("fair share of %s in %s not applied: %s", tenant, prefix, exc)
            return Ticket(None, prefix, token, weight, 0)
        ticket = Ticket(self, prefix, token, weight, 0, key)
        if not joined:  # admitted and charged before this replica took the job over
            return ticket
        try:
            await self._start(prefix, token, estimate, weight, key)
            ticket.estimate = estimate
        except Exception as exc:
            log.warning("fair share of %s in %s not waited for: %s", tenant, prefix, exc)
            ticket.key = None  # not known to be marked: settled as an unkeyed request
        except BaseException:
            ticket.key = None
            await ticket.settle(0)
            raise
        return ticket


def keyed_done(mine: TenantShare, change: str, key: str) -> bool | None:
    """What a keyed step returns without writing, when the entry shows it happened already
    (pure); None when it is still to do. A line in `charged` was joined and started; one in
    `settled` was charged what it served; a `leave` of a line in neither was settled and
    forgotten by another runner of it (or never marked), so it charges nothing."""
    known = key in mine.charged or key in mine.settled
    match change:
        case "join":
            return False if known else None
        case "start":
            return True if known else None
        case "forget":
            return None if key in mine.settled else True
        case _:
            return None if key in mine.charged else True


def _bounded(charged: dict[str, int]) -> dict[str, int]:
    """The newest CHARGED_MAX marks: a line whose job ended without settling it (its runner
    died, then the window closed) leaves a mark, and marks are bytes in every write."""
    if len(charged) <= CHARGED_MAX:
        return charged
    log.warning("fair share: %d lines charged and unsettled; the oldest forgotten", len(charged))
    return dict(list(charged.items())[-CHARGED_MAX:])


class Ticket:
    """One admitted request: `settle` (once; later calls do nothing) charges what it served
    less what was charged when it started; a keyed one's `forget` (after its result is
    recorded) drops its mark."""

    def __init__(self, fair: FairShare | None, prefix: str, tenant: str, weight: float,
                 estimate: int, key: str | None = None) -> None:
        self.fair, self.prefix, self.tenant = fair, prefix, tenant
        self.weight, self.estimate, self.key = weight, estimate, key
        self._forget = fair if key is not None else None

    async def settle(self, tokens: int) -> None:
        fair, self.fair = self.fair, None
        if fair is None:
            return
        try:
            await asyncio.shield(fair._change(self.prefix, self.tenant, "leave", tokens,
                                              self.weight, key=self.key, estimate=self.estimate))
        except Exception as exc:
            log.warning("fair share of %s in %s not charged: %s", self.tenant, self.prefix, exc)

    async def forget(self) -> None:
        """The keyed request's result is recorded: a later run of it is a new request."""
        fair, self._forget = self._forget, None
        if fair is None or self.key is None:
            return
        try:
            await asyncio.shield(fair._change(self.prefix, self.tenant, "forget", key=self.key))
        except Exception as exc:
            log.warning("fair share mark of %s in %s not dropped: %s", self.key, self.prefix, exc)
