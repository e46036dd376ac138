"""Fair tenants, applied where a task enters the queue: the gateway holds back a tenant's
task while that tenant is more than QUANTUM virtual tokens ahead of the least-served tenant
with requests waiting in the same (model, class) (fleet.bus.fairness: `holds`, `lift`,
`charge`), unless it holds fewer than its weighted share of the model's slots
(fleet.gateway.fair_slots), and charges what each task served when its request ends.

Why at admission: a class's tasks share one JetStream pull consumer, which hands them out in
publish order; a worker cannot reorder it without naks that spend the tasks' deliveries.
Holding the flooding tenant's next publish leaves the queue to the others' tasks, so they are
served next; the held task is published as soon as the others catch up (or stop waiting).

A tenant is backlogged while it has requests that are not yet running (held here, or queued
in the broker: no runner has accepted a task of theirs), as in VTC, not while its requests
run: a tenant whose requests all run holds nobody back, so the others' requests take the
free slots (work-conserving; counting running requests as waiting left half of the slots
idle in the queue bench). And while another tenant is present, a gateway keeps at most
QUEUED_CAP of a tenant's requests queued in the broker and not yet running: the broker
serves a class first in, first out, so a tenant admitted past that would queue ahead of the
next request of a tenant that arrives later (measured: B waited 10-24x its TTFT alone behind
A's queued requests). Each tenant's held requests take their turn one at a time, oldest
first, and check the rule against this replica's view of the counters before reading KV, so
a change wakes one request per tenant, not every held one. And a tenant that holds its
weighted share of the model's slots or more (running or queued) does not take the last free
slot while a present tenant holds no more than its share (fleet.gateway.fair_slots): that
tenant's next request finds a slot, not a wait for one to free.

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
from collections.abc import Callable, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.aio import set_within
from fleet.bus.fairness import charge, holds, lift, tenant_token
from fleet.gateway.fair_slots import entitled, kept_for
from fleet.wire.fairness import TenantShare

log = logging.getLogger(__name__)

BUCKET = "FLEET_FAIRNESS"
QUANTUM = 512.0  # virtual tokens a tenant may run ahead of the least-served waiting one
STALE_S = 60.0
HOLD_MAX_S = 120.0
RECHECK_S = 1.0  # a held request re-reads the counters at least this often (staleness)
# A tenant's requests this gateway admitted that no runner has accepted yet, while another
# tenant is present: enough to keep a slot that frees busy (it is refilled when one runs),
# few enough that a newcomer's request waits behind at most this many of its in the queue.
QUEUED_CAP = 1
CHARGED_MAX = 4096  # batch lines a tenant's entry marks as started (64 a job in flight)
SETTLED_MAX = 256  # settled lines awaiting their recorded result (normally a few)


def backlogged(shares: dict[str, TenantShare], now: float) -> list[str]:
    """The tenants with requests waiting (pure): a stale entry waits no more."""
    return [t for t, s in shares.items() if s.waiting > 0 and now - s.at < STALE_S]


def held_because(shares: dict[str, TenantShare], tenant: str, now: float, quantum: float,
                 queued_here: int, cap: int = QUEUED_CAP, slots: int = 0,
                 queued: Mapping[str, int] | None = None) -> str | None:
    """Why `tenant`'s next request waits (pure), or None to admit it: `ahead`, more than
    `quantum` ahead of the least-served tenant waiting too, unless it holds fewer than its
    weighted share of the `slots`: its share of the slots is its share of the tokens a
    batched engine serves (one a step each), and the last free slots are kept for it, so
    holding it too left them idle while the flooding tenant was held by the reserve (B's
    counter, lifted to A's and charged at each start, can drift a quantum ahead; B's next
    request then waited for one of A's to end); `queued`, this gateway has `cap` of its
    requests in the broker's queue, not yet running, while a tenant served less than
    it is present (an entry changed within STALE_S). The least-served tenant is never
    capped: its requests are the ones the queue should hold; nor is a tenant that holds
    fewer than its share of the `slots`: its requests are within what the reserve keeps for
    it, so they start at once (capped, a second request of B's sent beside its first waited
    at admission for the first to be accepted). `reserved`: it holds its share of the
    `slots` or more and the last free ones are kept for a present tenant at or below its
    share (fleet.gateway.fair_slots; `queued`: the slots this gateway knows a tenant holds
    beyond its entry's `running`: its requests published and not yet running, and writes of
    its `running` under way; `slots` 0: not known, no reserve)."""
    counters = {t: share.counter for t, share in shares.items()}
    held, weights = slots_held(shares, tenant, now, queued or {tenant: queued_here})
    within = slots > 0 and held[tenant] < entitled(slots, weights)[tenant]
    if not within and holds(counters, tenant, [*backlogged(shares, now), tenant], quantum):
        return "ahead"
    behind = any(t != tenant and now - share.at < STALE_S and share.counter < counters[tenant]
                 for t, share in shares.items())
    if behind and queued_here >= cap and not within:
        return "queued"
    if slots > 0 and kept_for(held, weights, tenant, slots) is not None:
        return "reserved"
    return None


def slots_held(shares: Mapping[str, TenantShare], tenant: str, now: float,
               queued: Mapping[str, int]) -> tuple[dict[str, int], dict[str, float]]:
    """The present tenants' slots held and weights (pure): a tenant is present while its
    entry is fresh and it has requests waiting or running (`tenant` always); it holds its
    requests running and what `queued` adds (this gateway's knowledge ahead of the entry)."""
    held: dict[str, int] = {}
    weights: dict[str, float] = {}
    for t, share in shares.items():
        fresh = now - share.at < STALE_S
        running = share.running if fresh else 0
        if t == tenant or (fresh and (share.waiting or running)) or queued.get(t, 0):
            held[t] = max(0, running + queued.get(t, 0))
            weights[t] = share.weight
    return held, weights


class View:
    """One (model, class)'s entries as this replica last saw them: loaded once by a watch
    (one short-lived consumer), then kept by a core subscription to the bucket's subjects
    (KV puts are published there), so a held request costs the server no consumer."""

    def __init__(self) -> None:
        self.shares: dict[str, TenantShare] = {}
        self.changed = asyncio.Event()  # replaced after each change: waiters hold the old one
        self.sub: Subscription | None = None
        # Tenants whose entry this replica is writing. A KV put reaches core subscribers as
        # it is published, before the writer has its answer, so the view showed a `run` or a
        # `leave` while the writer still counted it as under way (FairShare.moving): a leave
        # counted twice made a slot look free (B's slot went to A's next request, and B's next
        # one queued for the next slot to free); a run counted twice put B over its share, so
        # the last slot was not kept for it. A write's own value, and the end of its `moving`,
        # now enter the view together when its answer comes (`put`).
        self.writing: set[str] = set()

    def heard(self, tenant: str, data: bytes) -> None:
        """A put of `tenant`'s entry on the bucket's subject: seen now, or, while this replica
        writes that entry, not at all: the put is that write (its value enters the view when
        it is answered) or one that makes it fail (the writer reads the entry again and puts
        what it read), or a later one, which the next change of the entry brings, as a
        write's own value put after its answer always overwrote it."""
        if tenant not in self.writing and data:
            self.see(tenant, data)

    def see(self, tenant: str, data: bytes) -> None:
        self.put(tenant, TenantShare.model_validate_json(data))

    def put(self, tenant: str, share: TenantShare) -> None:
        self.shares[tenant] = share
        self.wake()

    def wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class FairShare:
    def __init__(self, nc: Client, kv: KeyValue, quantum: float | None = None,
                 queued_cap: int = QUEUED_CAP,
                 slots: Callable[[str], int] | None = None) -> None:
        self.nc = nc
        self.kv = kv
        self.quantum = QUANTUM if quantum is None else quantum
        self.queued_cap = queued_cap
        # model -> its instances' slots (0: not known): the reserve of fleet.gateway.fair_slots
        self.slots = slots or (lambda model: 0)
        self.views: dict[str, View] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        # (prefix, tenant): requests this gateway admitted that are not yet running.
        self.queued: dict[tuple[str, str], int] = {}
        # (prefix, tenant): this replica's writes of the tenant's `running` under way (a run
        # +1, the leave of one that ran -1), counted at once in the slots it holds: a tenant's
        # next request, sent as its last one ended, was held as at its share until the leave's
        # write landed (tens of ms under load), and a running request not yet written let
        # another tenant's request past the reserve.
        self.moving: dict[tuple[str, str], int] = {}
        # (prefix, tenant): its held requests take turns, oldest first (asyncio.Lock is FIFO).
        self._turns: dict[tuple[str, str], asyncio.Lock] = {}
        # entry key -> this replica's writes of it, one at a time: concurrent compare-and-sets
        # of one key from one process only fail each other (a tenant's 80 requests joining
        # at once each read, conflict and read again), so they queue here instead.
        self._writing: dict[str, asyncio.Lock] = {}

    def _held(self, view: View, prefix: str, tenant: str, mine: TenantShare | None = None,
              ) -> str | None:
        shares = dict(view.shares)
        if mine is not None:
            shares[tenant] = mine
        shares.setdefault(tenant, TenantShare(counter=0.0, waiting=0, at=0.0))
        return held_because(shares, tenant, time.time(), self.quantum,
                            self.queued.get((prefix, tenant), 0), self.queued_cap,
                            self.slots(prefix.rsplit(".", 1)[0]), self.holding(prefix))

    def holding(self, prefix: str) -> dict[str, int]:
        """The slots each tenant holds in (model, class) beyond its entry's `running`, as
        this replica knows first: its requests queued here, and its writes of `running`
        under way."""
        holding = {t: n for (p, t), n in self.queued.items() if p == prefix and n}
        for (p, t), n in self.moving.items():
            if p == prefix and n:
                holding[t] = holding.get(t, 0) + n
        return holding

    def move(self, prefix: str, tenant: str, by: int) -> None:
        """A write of the tenant's `running` begins (`by` +-1) or is done (the opposite)."""
        key = (prefix, tenant)
        self.moving[key] = self.moving.get(key, 0) + by
        if (view := self.views.get(prefix)) is not None:
            view.wake()  # the held: the slots it counts changed

    def landing(self, prefix: str, tenant: str, by: int) -> Callable[[], None]:
        """`move(by)` once, at the first call: when a write's value enters the view
        (`_change`'s `landed`), or after it failed."""
        done = False

        def land() -> None:
            nonlocal done
            if not done:
                done = True
                self.move(prefix, tenant, by)
        return land

    def ran(self, prefix: str, tenant: str) -> None:
        """One of the tenant's admitted requests is running (or ended before it ran): its
        place in the queue is free; a held request of it may try again."""
        key = (prefix, tenant)
        self.queued[key] = max(0, self.queued.get(key, 0) - 1)
        if (view := self.views.get(prefix)) is not None:
            view.wake()  # the held: the change is local, not in KV

    async def _view(self, prefix: str) -> View:
        if (view := self.views.get(prefix)) is not None:
            return view
        async with self._opening.setdefault(prefix, asyncio.Lock()):
            if (view := self.views.get(prefix)) is not None:
                return view
            view = View()

            async def on_put(msg: Msg) -> None:
                view.heard(msg.subject.rsplit(".", 1)[1], msg.data)

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
                      estimate: int = 0, ran: bool = False,
                      landed: Callable[[], None] | None = None) -> bool:
        """Compare-and-set one tenant's entry; False for a `start` that must wait, or a keyed
        `join` whose request was admitted already (by a replica that ran its batch job).
        `join`: waiting + 1, lifted to the least waiting counter when it was idle.
        `start`: unless the tenant is held, charge the request's estimate now, so the
        tenant's other held requests see it at once (they all set this one key, so only one
        of them passes on the same reading).
        `run`: waiting - 1, running + 1 (a task of the request was accepted: it is no
        longer backlogged; it holds a slot).
        `leave`: charged `tokens` served less what its start charged; waiting - 1, or
        running - 1 if it ran (`ran`).
        `forget`: a keyed request's result is recorded; its `settled` mark goes.
        `landed` is called as the write's value enters the view, with no wait between.
        A `key` (a batch line's task id) makes each step happen once per key, whoever runs
        the line: the marks are in the entry the counter is, set by the same write."""
        view = await self._view(prefix)
        entry_key = f"{prefix}.{tenant}"
        async with self._writing.setdefault(entry_key, asyncio.Lock()):
            return await self._changed(view, entry_key, prefix, tenant, change, tokens,
                                       weight, force, key, estimate, ran, landed)

    async def _changed(self, view: View, entry_key: str, prefix: str, tenant: str,
                       change: str, tokens: float, weight: float, force: bool,
                       key: str | None, estimate: int, ran: bool,
                       landed: Callable[[], None] | None) -> bool:
        """`_change`'s compare-and-set loop, run by one writer of the key at a time."""
        failed = False
        while True:
            try:
                entry = await self.kv.get(entry_key)
                revision: int | None = entry.revision
                mine = TenantShare.model_validate_json(entry.value or b"")
            except KeyNotFoundError:
                revision, mine = None, TenantShare(counter=0.0, waiting=0, at=0.0)
            if failed:  # another replica wrote it meanwhile: its put was not heard (View.heard)
                view.put(tenant, mine)
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
                    running=mine.running if now - mine.at < STALE_S else 0,
                    charged=mine.charged, settled=mine.settled, weight=mine.weight)
            elif change == "start":
                if not force and self._held(view, prefix, tenant, mine) is not None:
                    return False
                new = mine.model_copy(update={"at": now, "counter": charge(
                    counters, tenant, int(tokens), weight)[tenant]})
                if key is not None:
                    new = new.model_copy(update={"charged": _bounded(
                        {**mine.charged, key: int(tokens)})})
            elif change == "forget":
                new = mine.model_copy(update={
                    "settled": [k for k in mine.settled if k != key]})
            elif change == "run":
                new = mine.model_copy(update={"waiting": max(0, mine.waiting - 1),
                                              "running": mine.running + 1, "at": now})
            else:
                if key is not None:
                    estimate = mine.charged[key]
                counter = max(0.0, mine.counter + (tokens - estimate) / weight)
                new = mine.model_copy(update={
                    "counter": counter, "at": now,
                    "waiting": mine.waiting if ran else max(0, mine.waiting - 1),
                    "running": max(0, mine.running - 1) if ran else mine.running})
                if key is not None:
                    new = new.model_copy(update={
                        "charged": {k: v for k, v in mine.charged.items() if k != key},
                        "settled": [*mine.settled, key][-SETTLED_MAX:]})
            if change not in ("forget", "run"):  # what a worker divides NATS tokens by
                new = new.model_copy(update={"weight": weight})
            view.writing.add(tenant)
            try:
                written = await self._set(entry_key, new, revision)
            finally:
                view.writing.discard(tenant)
            if written:
                if landed is not None:
                    landed()
                view.put(tenant, new)
                return True
            failed = True

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
        turn = self._turns.setdefault((prefix, tenant), asyncio.Lock())
        # Nobody of the tenant held here and the view admits it: no turn to take (a tenant
        # alone admits its requests side by side, not one at a time).
        if not turn.locked() and self._held(view, prefix, tenant) is None and \
                await self._change(prefix, tenant, "start", estimate, weight, key=key):
            self.queued[(prefix, tenant)] = self.queued.get((prefix, tenant), 0) + 1
            return
        async with turn:
            while True:
                changed = view.changed
                # The view first (no KV read): only a request it would admit reads its entry.
                if self._held(view, prefix, tenant) is None and await self._change(
                        prefix, tenant, "start", estimate, weight, key=key):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    log.info("fair share: %s held %.0f s, released", prefix, HOLD_MAX_S)
                    await self._change(prefix, tenant, "start", estimate, weight, force=True,
                                       key=key)
                    break
                # nothing changed within RECHECK_S: re-read anyway, for entries gone stale
                await set_within(changed, min(RECHECK_S, left))
            self.queued[(prefix, tenant)] = self.queued.get((prefix, tenant), 0) + 1

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
            ticket.admitted = True
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
    """One admitted request: `running` (once, when a runner accepts a task of it) takes it
    out of its tenant's backlog; `settle` (once; later calls do nothing) charges what it
    served less what was charged when it started; a keyed one's `forget` (after its result
    is recorded) drops its mark."""

    def __init__(self, fair: FairShare | None, prefix: str, tenant: str, weight: float,
                 estimate: int, key: str | None = None) -> None:
        self.fair, self.prefix, self.tenant = fair, prefix, tenant
        self.weight, self.estimate, self.key = weight, estimate, key
        self._forget = fair if key is not None else None
        self.admitted = False  # counted in this gateway's queued requests of its tenant
        self._run: asyncio.Task[bool] | None = None  # its `run` change; settle awaits it

    def _dequeue(self, fair: FairShare) -> None:
        if self.admitted:
            self.admitted = False
            fair.ran(self.prefix, self.tenant)

    def running(self) -> None:
        """A runner accepted a task of the request (called by its event reader, so not a
        coroutine): its place in the queue frees at once, and its entry's `waiting` drops by
        a write this ticket owns until `settle`."""
        if self.fair is None or self._run is not None:
            return
        self._dequeue(self.fair)
        self.fair.move(self.prefix, self.tenant, 1)
        # Owned by this ticket: `settle` awaits it; `_written` logs a failed write.
        self._run = asyncio.ensure_future(self._written(self.fair))

    async def _written(self, fair: FairShare) -> bool:
        landed = fair.landing(self.prefix, self.tenant, -1)  # in the view now, or not at all
        try:
            return await fair._change(self.prefix, self.tenant, "run", weight=self.weight,
                                      landed=landed)
        except Exception as exc:
            log.warning("fair share of %s in %s: running not written: %s", self.tenant,
                        self.prefix, exc)
            return False
        finally:
            landed()

    async def settle(self, tokens: int) -> None:
        fair, self.fair = self.fair, None
        if fair is None:
            return
        self._dequeue(fair)  # ended before it ran
        ran = False
        if self._run is not None:
            ran = await asyncio.shield(self._run)  # never raises: failures are logged
        landed = None
        if ran:
            fair.move(self.prefix, self.tenant, -1)  # its slot is free from now
            # the view counts it as its entry does from the moment the leave lands in it
            landed = fair.landing(self.prefix, self.tenant, 1)
        try:
            await asyncio.shield(fair._change(self.prefix, self.tenant, "leave", tokens,
                                              self.weight, key=self.key, estimate=self.estimate,
                                              ran=ran, landed=landed))
        except Exception as exc:
            log.warning("fair share of %s in %s not charged: %s", self.tenant, self.prefix, exc)
        finally:
            if landed is not None:
                landed()  # not written (or a cancelled settle): KV still counts it

    async def forget(self) -> None:
        """The keyed request's result is recorded: a later run of it is a new request."""
        fair, self._forget = self._forget, None
        if fair is None or self.key is None:
            return
        try:
            await asyncio.shield(fair._change(self.prefix, self.tenant, "forget", key=self.key))
        except Exception as exc:
            log.warning("fair share mark of %s in %s not dropped: %s", self.key, self.prefix, exc)
