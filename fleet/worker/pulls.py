"""Pulling tasks: one bound pull subscription per model and priority class on its shared
durable consumer, taken highest class first (fleet.worker.priority: order, batch slack,
starvation promotion); within a class's turn, after its shared durable, the class's tenant
lanes in their fair order (fleet.worker.lanes).

A pull asks each class in turn for what its quota allows and the durable holds now (a
`no_wait` pull, answered at once); when no class had anything, it waits (up to FETCH_WAIT_S) on
every class that may be served at once and returns the first that answers, so a task of
any class starts as soon as it is published. The other waits are cancelled, but their pull
requests linger on the server until they expire, and a task published meanwhile is delivered
to one of them: held here unseen, it would wait for this worker's next pull of its class (a
two-worker test saw a batch task wait 20 s for a busy worker's slot while the other worker
idled). So each such request is watched until it expires (`_sweep`): a task it brings is
taken by this worker's next pull of its class if one comes meanwhile (delivery 1, as before),
and otherwise given back then (nak: one delivery spent), so a worker that pulls gets it.

Such a request also stands for its class (fleet.worker.standing): while it is open and has
brought nothing the class holds no task, so the next fetch sends that class no pull and
waits for what the request brings. The class whose wait took a task gets a request posted
again at once when a slot is left for it, so at light load a fetch sends no pull at all and
a task is delivered as it is stored (issue 23: a round of `no_wait` pulls out when the next
task came cost it ~1 ms).

Any class's durable (`tasks-<model>`, `interactive-tasks-<model>`, `batch-tasks-<model>`) can
vanish under a running worker (someone deleted it, a stream was recreated). A pull then fails
with 503 (no responders), exactly as it does during a leader election; so after a failed pull
each durable this worker bound for the model is looked up, and one the server says does not
exist is created again (`ensure_task_consumer`, logged, counted in `recreated`) and its
subscription rebound. A durable whose configuration was changed is restored before binding,
and checked while pulling (fleet.worker.consumer_guard); one that cannot be restored stops
this model's pulls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry.metrics import Meter

from fleet.aio import cancel_and_wait, started
from fleet.bus.provision import ensure_task_consumer
from fleet.bus.retry import BrokerUnavailable, is_transient
from fleet.bus.task_queue import TaskQueue
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.tasks import Priority
from fleet.worker.consumer_guard import ConsumerGuard
from fleet.worker.lanes import Lanes, reads_counts
from fleet.worker.priority import CLASSES, Turn, pull_order, quota
from fleet.worker.pull_now import next_delivered, pull_now, pull_waiting
from fleet.worker.standing import Cover, Step, covered, round_step, stands

log = logging.getLogger(__name__)

FETCH_WAIT_S = 2.0
# While batch work is held back by the reserve: a slot that frees meanwhile is only seen by
# the next pull, so the wait on the other classes is short (a round of 4 small requests).
SLACK_WAIT_S = 0.2
LANES_RECENT_S = 60.0  # lanes that held tasks this recently are looked at every SLACK_WAIT_S
ERROR_PAUSE_S = 0.5
STRAY_MARGIN_S = 0.5  # past a lingering request's expiry: the server's clock and the transit
# A durable's look-up after a failed pull: an election's answer is worth a short wait, not the
# pull loop's standstill (the next failed pull looks again).
LOOKUP_BUDGET_S = 2.0


async def unsubscribe_pull(sub: JetStreamContext.PullSubscription) -> None:
    """Drop a pull subscription before the connection drains: a fetch cancelled mid-wait
    leaves the server's late answer queued unread, and draining waits on it for 30 s."""
    try:
        await sub.unsubscribe()
    except Exception as exc:  # closing anyway: say so, nothing to retry
        log.debug("pull subscription not unsubscribed: %s", exc)


class TaskPuller:
    def __init__(
        self, nc: Client, js: JetStreamContext, settings: Settings, meter: Meter | None = None
    ) -> None:
        self.nc = nc
        self.js = js
        self.queue = TaskQueue(nc, js, budget_s=LOOKUP_BUDGET_S)
        self.settings = settings
        self.subs: dict[str, JetStreamContext.PullSubscription] = {}
        self.recreated: dict[str, int] = {}  # durable -> times it was recreated
        self.stopped: dict[str, str] = {}  # model -> why its pulls stopped (a changed consumer)
        # the other classes' subscriptions (the guard watches these durables too)
        self.class_subs: dict[tuple[str, str], JetStreamContext.PullSubscription] = {}
        self.last_served: dict[str, dict[str, float]] = {}  # model -> class -> last turn
        # (model, class) -> the watch of a cancelled wait's request until it expires
        self.sweeps: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.strays: dict[tuple[str, str], list[Msg]] = {}  # brought by such a request
        self.covers: dict[tuple[str, str], Cover] = {}  # that request, while it is open
        # model -> a request brought a task, or ended (while a wait of the model's is on)
        self.arrived: dict[str, asyncio.Future[None]] = {}
        self.given_back = 0  # strays no pull of their class took before the request expired
        self.guard = ConsumerGuard(nc, self, settings.max_deliver, settings.ack_wait_s, meter)
        self.lanes = Lanes(nc, js, settings)  # tenant lanes (fleet.worker.lanes)
        self.lanes_seen: dict[str, float] = {}  # model -> when its lanes last held tasks
        self.lanes_read: dict[str, float] = {}  # model -> when its lanes' counts were asked
        # Told of what a fetch brought before the fetch returns (the worker sends the tasks'
        # claims from here: fleet.worker.intake.Intake.ahead).
        self.on_fetched: Callable[[list[Msg]], Awaitable[None]] | None = None

    async def fetch(
        self, model: str, batch: int, reserve: int = 0, only: Priority | None = None,
        interrupt: asyncio.Event | None = None,
    ) -> list[Msg]:
        """Up to `batch` tasks of `model`, highest class first, batch work leaving `reserve`
        slots free (`only`: of that class alone); waiting at most about FETCH_WAIT_S, or until
        `interrupt` is set (a preemption probe whose model freed a slot); never raises."""
        got = await self._fetch(model, batch, reserve, only, interrupt)
        if got and self.on_fetched is not None:
            try:
                await self.on_fetched(got)
            except Exception as exc:  # what it does is done again later: said, not raised
                log.warning("fetched tasks' early work failed: %r", exc)
        return got

    async def _fetch(
        self, model: str, batch: int, reserve: int, only: Priority | None,
        interrupt: asyncio.Event | None,
    ) -> list[Msg]:
        if model in self.stopped:
            return []
        now = time.monotonic()
        served = self.last_served.setdefault(model, dict.fromkeys(CLASSES, now))
        got: list[Msg] = []
        turns = []
        failed = False
        # The lanes' counts, asked for now and read at the first class that needs them: the
        # look-up (a stream info) was a round trip of its own after the first class's pull,
        # and a task published meanwhile waited for it and the later pulls before the wait
        # that takes it went out (issue 23: ~3.5 ms of a 4 ms round at light load). Not at
        # every fetch while no lane is in use (fleet.worker.lanes.reads_counts).
        lane_counts: asyncio.Future[dict[str, int]] | None = None
        if reads_counts(now, self.lanes_seen.get(model), self.lanes_read.get(model),
                        LANES_RECENT_S):
            self.lanes_read[model] = now
            lane_counts = started(self._lane_counts(model), f"lane counts of {model}")
        try:
            for turn in pull_order(served, now):
                if only is not None and turn.priority != only:
                    continue
                wanted = min(quota(turn, batch - len(got), reserve), batch - len(got))
                step = round_step(wanted, self._covered(model, turn.priority))
                if step is Step.SKIP:
                    continue
                served[turn.priority] = now  # it had its turn: not starved
                try:
                    # Covered: an open request of ours holds the class's next task for us.
                    taken = (await self._pull(model, turn.priority, wanted, None)
                             if step is Step.PULL else [])
                    got += taken
                    if len(taken) < wanted:  # the rest of the class's turn: its tenant lanes
                        got += await self._from_lanes(model, turn.priority,
                                                      wanted - len(taken), lane_counts)
                except Exception as exc:
                    # One class's consumer unreachable (its leader paused or electing) must not
                    # stop the others: a fault test saw a worker pull nothing for seconds so.
                    log.warning("fetch of %s's %s class failed: %s", model, turn.priority,
                                type(exc).__name__ + f" {exc}".rstrip())
                    failed = True
                    continue
                turns.append(turn)
            if failed:
                await self._recover(model)
                if not got:
                    await asyncio.sleep(ERROR_PAUSE_S)  # pacing a retry after a broker error
                return got
            if not got and turns:
                # A class held back by the reserve (batch) waits for a slot to free, which
                # this pull cannot see: wait briefly, so the next pull can give it that slot.
                held_back = only is None and len(turns) < len(CLASSES)
                # A lane has no wait of its own here: while lanes are in use, the next look
                # at them comes after a short wait (a lane task waits at most about that).
                lanes_in_use = now - self.lanes_seen.get(model, float("-inf")) < LANES_RECENT_S
                # A pull for one class alone is the preemption probe of a full worker: while
                # it waits, the model has a pull in flight and a slot that frees gets none,
                # so it waits briefly (a 2 s probe held freed slots idle up to 2 s each).
                short = held_back or lanes_in_use or only is not None
                got = await self._first_of(model, turns, SLACK_WAIT_S if short
                                           else FETCH_WAIT_S, interrupt)
                delivered = {subjects.priority_of_task_subject(msg.subject) for msg in got}
                for turn in turns:
                    if turn.priority not in delivered:
                        continue
                    if stands(True, quota(turn, batch - len(got), reserve)):
                        await self._stand(model, turn.priority)
                    else:  # its request is spent: the class is pulled again
                        await self._end_sweep(model, turn.priority)
            return got
        except Exception as exc:  # the loop must go on; the next plan pulls again
            log.warning("fetch for %s failed: %s", model, type(exc).__name__ + f" {exc}".rstrip())
            await self._recover(model)
            await asyncio.sleep(ERROR_PAUSE_S)  # pacing a retry after a broker error
            return got
        finally:  # owned here: unread when the first class filled the batch
            if lane_counts is not None:
                await cancel_and_wait([lane_counts])

    async def _pull(
        self, model: str, priority: Priority, batch: int, wait_s: float | None
    ) -> list[Msg]:
        """`wait_s` None: only what the durable holds now; else the next task, waiting up to
        `wait_s` for it (`_first_of`'s waits, of one task: fleet.worker.pull_now)."""
        await self._end_sweep(model, priority)  # the subscription's queue is this pull's now
        sub = self._bound(model, priority) or await self._subscribe(model, priority)
        # Taken once nothing is left to await before they are returned: a wait cancelled
        # while it bound its class (after a failed pull) leaves them for the next pull.
        held = self.strays.pop((model, priority), [])
        if held or wait_s is None:
            return held + (await pull_now(sub, batch - len(held)) if batch > len(held) else [])
        # Not nats-py's fetch: `_first_of` cancels the waits that did not answer first, and a
        # fetch so cancelled just as its task came dropped the task (it came back after
        # AckWait, 30 s); this one leaves it queued for the request's sweep.
        return await pull_waiting(sub, wait_s)

    async def _lane_counts(self, model: str) -> dict[str, int]:
        """The counts of `model`'s tenant lanes; never raises."""
        try:
            counts = await self.lanes.counts(model)
        except Exception as exc:  # the lanes wait for the next fetch; the classes do not
            log.warning("lanes of %s not read: %s", model, type(exc).__name__)
            return {}
        if any(counts.values()):
            self.lanes_seen[model] = time.monotonic()
        return counts

    async def _from_lanes(self, model: str, priority: Priority, wanted: int,
                          counts: asyncio.Future[dict[str, int]] | None) -> list[Msg]:
        """Up to `wanted` tasks of the class's tenant lanes (fleet.worker.lanes), with the
        counts this fetch asked for at its start (None: it asked for none, no lane pulled)."""
        if counts is None:
            return []
        return await self.lanes.pull(model, priority, wanted, await asyncio.shield(counts))

    async def _first_of(self, model: str, turns: list[Turn], wait_s: float,
                        interrupt: asyncio.Event | None = None) -> list[Msg]:
        """Wait on every class that may be served at once; the first to answer wins (or
        `interrupt`, which ends the wait with nothing). A class covered by a standing request
        (fleet.worker.standing) gets no new request: its request's task, when it comes, is
        taken from its sweep. The other waits are cancelled: a message that reaches a
        cancelled fetch stays in that subscription's queue and the next pull of its class
        takes it first. A wait that failed (a 503) raises only when no other brought a task;
        else the tasks are returned and the model's durables looked after (`_recover`)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        until = now + wait_s + STRAY_MARGIN_S
        reconnects = self._reconnects()
        standing = {t.priority: self.covers[(model, t.priority)] for t in turns
                    if self._covered(model, t.priority)}
        # Strays of covered classes: none now (else not covered). A plain future, set by
        # `_arrive`: no task of its own to wake first (one loop pass of a task's way, issue 23).
        watch = self.arrived[model] = loop.create_future() if standing else None
        waits = {t.priority: asyncio.ensure_future(self._pull(model, t.priority, 1, wait_s))
                 for t in turns if t.priority not in standing}
        # Owned here: cancelled below however the wait ends (an Event's wait cannot fail).
        stop = asyncio.ensure_future(interrupt.wait()) if interrupt is not None else None
        # Not past the earliest standing request's expiry: then that class is open again.
        timeout = min([wait_s, *(c.until - now for c in standing.values())]) if standing else None
        try:
            await asyncio.wait([*waits.values(), *(f for f in (stop, watch) if f is not None)],
                               timeout=max(0.0, timeout) if timeout is not None else None,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (stop, watch):
                if future is not None:
                    future.cancel()
            if watch is not None and self.arrived.get(model) is watch:
                del self.arrived[model]
        pending = {wait for wait in waits.values() if not wait.done()}
        for wait in pending:
            wait.cancel()
        got: list[Msg] = []
        failed: BaseException | None = None
        for turn in turns:
            key = (model, turn.priority)
            if turn.priority in standing:
                # A task it brought spends its request: the fetch posts the next one, which
                # its sweep goes on reading, or ends the sweep (`_stand`, `_end_sweep`).
                got += self.strays.pop(key, [])
                continue
            wait = waits[turn.priority]
            if wait in pending:
                # One that finished before its cancel landed brings its messages: dropped,
                # they would wait for AckWait.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    got += await wait
                if (sub := self._bound(model, turn.priority)) is not None:
                    self._watch(key, sub, until, reconnects)
            elif (error := wait.exception()) is not None:
                # Read on: another class's wait may have brought a task in the same pass,
                # and raising here dropped it (delivered, unacked: back after AckWait).
                failed = failed or error
            else:
                got += wait.result()
        if failed is not None:
            if not got:
                raise failed  # the fetch's own handling: recover, pause, pull again
            log.warning("a wait of %s failed beside tasks brought: %s", model,
                        type(failed).__name__ + f" {failed}".rstrip())
            await self._recover(model)  # as the fetch does after a failed pull
        return got

    async def _stand(self, model: str, priority: Priority) -> None:
        """Post a standing request for the class's next task (fleet.worker.standing), watched
        as a cancelled wait's is; never raises (without it the class is pulled as before)."""
        key = (model, priority)
        if (sub := self._bound(model, priority)) is None:
            await self._end_sweep(model, priority)
            return
        # The spent request's sweep, still reading the subscription, reads what the new one
        # brings: one task's sweep ended and the next one's started were two loop passes
        # and a task on each task's way to its runner (issue 23).
        sweep = self.sweeps.get(key)
        if sweep is None or sweep.done() or self.strays.get(key):
            await self._end_sweep(model, priority)
            sweep = None
        until = asyncio.get_running_loop().time() + FETCH_WAIT_S + STRAY_MARGIN_S
        reconnects = self._reconnects()
        request = orjson.dumps({"batch": 1, "expires": int(FETCH_WAIT_S * 1e9)})
        try:
            await self.nc.publish(sub._nms, request, reply=sub._deliver)
        except Exception as exc:  # not posted: the class's next fetch pulls it
            log.debug("standing request of %s's %s class not posted: %s", model, priority, exc)
            await self._end_sweep(model, priority)
            return
        if sweep is not None and self.sweeps.get(key) is sweep:
            self.covers[key] = Cover(until - STRAY_MARGIN_S, reconnects)  # read by the sweep
        else:
            self._watch(key, sub, until, reconnects)

    def _watch(self, key: tuple[str, str], sub: JetStreamContext.PullSubscription,
               until: float, reconnects: int) -> None:
        """Sweep what a request left open brings until it expires; until then it covers its
        class (the request's own expiry: `until` less the margin)."""
        self.covers[key] = Cover(until - STRAY_MARGIN_S, reconnects)
        self.sweeps[key] = started(self._sweep(key, sub, until),
                                   f"stray tasks of {key[0]}'s {key[1]} class")

    def _covered(self, model: str, priority: str) -> bool:
        key = (model, priority)
        return key in self.sweeps and covered(
            self.covers.get(key), len(self.strays.get(key, ())),
            asyncio.get_running_loop().time(), self._reconnects())

    def _reconnects(self) -> int:
        return int(self.nc.stats.get("reconnects", 0))

    async def _sweep(
        self, key: tuple[str, str], sub: JetStreamContext.PullSubscription, until: float
    ) -> None:
        """Until a cancelled wait's request expires, what it brings is kept for this worker's
        next pull of the class (which ends the sweep); what no pull took is given back."""
        loop = asyncio.get_running_loop()
        while (left := self._sweep_until(key, until) - loop.time()) > 0:
            try:
                msg = await next_delivered(sub._sub, left)
            except TimeoutError:
                continue  # ended, unless a request posted since moved its end on
            if not JetStreamContext.is_status_msg(msg):  # else: expired (408), a heartbeat
                self.strays.setdefault(key, []).append(msg)
                self._arrive(key[0])
        if self.sweeps.get(key) is asyncio.current_task():
            del self.sweeps[key]
            self.covers.pop(key, None)
            self._arrive(key[0])  # a wait on it ends: its class is pulled again
        for msg in self.strays.pop(key, []):
            self.given_back += 1
            log.info("a %s task of %s (%s) reached a wait this worker had left and no pull of "
                     "its class came: given back", key[1], key[0],
                     (msg.headers or {}).get("Nats-Msg-Id", "no id"))
            with contextlib.suppress(Exception):  # shielded: settled even if cancelled now
                await asyncio.shield(msg.nak())

    def _sweep_until(self, key: tuple[str, str], until: float) -> float:
        """When a sweep ends: its request's expiry, moved on by a request posted after it
        (`_stand`), plus the margin; `until` once its cover is gone (it is being ended)."""
        cover = self.covers.get(key)
        return until if cover is None else cover.until + STRAY_MARGIN_S

    def _arrive(self, model: str) -> None:
        if (arrived := self.arrived.get(model)) is not None and not arrived.done():
            arrived.set_result(None)

    async def _end_sweep(self, model: str, priority: str) -> None:
        self.covers.pop((model, priority), None)
        if (sweep := self.sweeps.pop((model, priority), None)) is not None:
            await cancel_and_wait([sweep], 1.0)

    def _bound(
        self, model: str, priority: Priority
    ) -> JetStreamContext.PullSubscription | None:
        return self.subs.get(model) if priority == "default" else self.class_subs.get(
            (model, priority))

    async def _recover(self, model: str) -> None:
        """After a failed fetch: recreate each durable of `model` this worker bound that is
        gone. A class other than the default is dropped either way, to be bound again (its
        durable made again) at its next turn; the default one is rebound here."""
        for priority in CLASSES:
            await self._end_sweep(model, priority)
        bound = [("default", self.subs)] if model in self.subs else []
        bound += [(p, self.class_subs) for (m, p) in list(self.class_subs) if m == model]
        for priority, _ in bound:
            name = subjects.durable(model, priority)
            try:
                gone = await self.queue.durable(name) is None
            except BrokerUnavailable:
                gone = False  # not answered within the look-up's budget: the next one asks
            except Exception as exc:
                gone = False
                if not is_transient(exc):
                    log.warning("consumer %s not checked: %s", name, exc)
            if gone:
                log.warning("consumer %s is gone (deleted under this worker): recreating it",
                            name)
                self.recreated[name] = self.recreated.get(name, 0) + 1
            if priority != "default":
                if sub := self.class_subs.pop((model, priority), None):
                    await unsubscribe_pull(sub)
                continue
            if gone:
                await unsubscribe_pull(self.subs.pop(model))
                try:
                    await self._subscribe(model)
                except Exception as exc:
                    log.warning("consumer %s not recreated yet: %s", name, exc)

    async def stop_pulling(self, model: str, reason: str) -> None:
        self.stopped[model] = reason
        for priority in CLASSES:
            await self._end_sweep(model, priority)
        if sub := self.subs.pop(model, None):
            await unsubscribe_pull(sub)
        for priority in CLASSES:
            if sub := self.class_subs.pop((model, priority), None):
                await unsubscribe_pull(sub)

    async def _subscribe(
        self, model: str, priority: Priority = "default"
    ) -> JetStreamContext.PullSubscription:
        await self.guard.check(model, priority, binding=True)
        await ensure_task_consumer(
            self.nc, model, max_deliver=self.settings.max_deliver,
            ack_wait_s=self.settings.ack_wait_s, priority=priority,
        )
        sub = await self.js.pull_subscribe_bind(
            subjects.durable(model, priority), stream=subjects.TASKS_STREAM
        )
        if priority == "default":
            self.subs[model] = sub
        else:
            self.class_subs[(model, priority)] = sub
        return sub

    async def close(self) -> None:
        await cancel_and_wait(list(self.sweeps.values()), 1.0)
        await self.lanes.close()
        for sub in [*self.subs.values(), *self.class_subs.values()]:
            await unsubscribe_pull(sub)
