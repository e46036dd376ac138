"""Tenant lanes: fair tenants among tasks published straight on NATS, within a class.

A NATS publisher that wants its tasks shared fairly publishes them on its tenant's lane,
`fleet.tasks.<model>.<class>.<tenant>` (subjects.lane; the class named even for `default`),
not on the class's shared subject. Each lane has its own durable pull consumer
(subjects.lane_durable, made by the first worker that pulls it; it goes by its inactive
threshold once unused), so the broker keeps every tenant's tasks in a line of its own and a
worker chooses whose task it takes next: within a class turn (fleet.worker.pulls), after the
class's shared durable (gateway-admitted tasks, which took their fair turn at admission, and
tasks without a lane), the lanes with tasks stored are pulled in the order of their tenants'
virtual token counters in KV FLEET_FAIRNESS (`fair_order`: least served over weight first,
the rule of fleet.bus.fairness). The ending charges each lane task's tokens to that same
entry (fleet.worker.fair_charge), so the order holds across workers: its state is in NATS.

A tenant idle while others were served would come back with a counter far behind and take
every slot until it caught up: a lane's counter more than CREDIT virtual tokens behind the
least of the other lanes with tasks is raised to that (`lifts`, written by compare-and-set,
only ever up), so no tenant banks more than CREDIT of credit.

Nothing here sends a verb other than the pull: a lane task is taken only into a free slot,
as a shared-queue task is, so no task is held, deferred or nak'd for fairness (no delivery
spent toward max_deliver and the dead letters). Continuation, claims, deadlines and dead
letters see a lane task as any other (its subject names its model and class).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.bus.fairness import next_tenant
from fleet.bus.provision import consumer_definition, jetstream_api
from fleet.bus.roles import FAIRNESS
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.fairness import TenantShare
from fleet.worker.pull_now import pull_now

log = logging.getLogger(__name__)

CREDIT = 512.0  # virtual tokens a lane may be behind the least-served other lane with tasks
# What one pick is assumed to serve, so several slots filled by one pull spread over the
# lanes before the endings' real charges come (a guess: the charge corrects it).
ESTIMATE = 256.0
# An unused lane's durable is removed by the server after this long. A held task keeps it:
# its in_progress beats and acks count as activity (nats-server #3635), and so do pending
# acks within AckWait (#7052, 2.11.x); a pull of a lane with tasks stored does too.
INACTIVE_S = 3600.0
LOOKUP_BUDGET_S = 2.0
# While no lane of a model has held tasks lately, a fetch reads the lanes' counts at most this
# often: the read is a FLEET_TASKS stream info (a round trip and ~100 us of the worker loop's
# CPU to parse), and every fetch made one, one a task at light load, where no lane was ever
# used (issue 23). A lane's first task so waits at most about this long for a worker busy
# with shared tasks (an idle worker's fetch waits up to its FETCH_WAIT_S anyway).
LOOK_EVERY_S = 0.2


def reads_counts(now: float, seen: float | None, read: float | None, recent: float,
                 every: float = LOOK_EVERY_S) -> bool:
    """Pure. Whether a fetch reads the lanes' counts: always while a lane held tasks within
    `recent` seconds (`seen`: when a read last found some), else when the last read (`read`)
    is `every` old or there was none."""
    if seen is not None and now - seen < recent:
        return True
    return read is None or now - read >= every


def backlog(counts: Mapping[str, int], priority: str) -> dict[str, int]:
    """The lanes of one class with tasks stored (pure), from FLEET_TASKS' per-subject counts
    of a model's lanes: tenant -> tasks (delivered-and-running ones included)."""
    lanes: dict[str, int] = {}
    for subject, count in counts.items():
        tenant = subjects.tenant_of_task_subject(subject)
        if (tenant is not None and count > 0
                and subjects.priority_of_task_subject(subject) == priority):
            lanes[tenant] = lanes.get(tenant, 0) + count
    return lanes


def lifts(counters: Mapping[str, float], lanes: Iterable[str],
          credit: float = CREDIT) -> dict[str, float]:
    """The lanes whose counter is raised, and to what (pure): those more than `credit`
    behind the least counter of the other lanes with tasks."""
    lanes = list(lanes)
    raised: dict[str, float] = {}
    for tenant in lanes:
        others = [counters.get(t, 0.0) for t in lanes if t != tenant]
        if others and counters.get(tenant, 0.0) < min(others) - credit:
            raised[tenant] = min(others) - credit
    return raised


def fair_order(counters: Mapping[str, float], weights: Mapping[str, float],
               lanes: Iterable[str], picks: int, estimate: float = ESTIMATE) -> list[str]:
    """Whose task each of `picks` slots takes (pure): the least counter first (ties by
    name), each pick adding `estimate` over the tenant's weight to its counter here."""
    local = dict(counters)
    lanes = list(lanes)
    order: list[str] = []
    for _ in range(picks):
        tenant = next_tenant(local, lanes)
        if tenant is None:
            break
        order.append(tenant)
        local[tenant] = local.get(tenant, 0.0) + estimate / weights.get(tenant, 1.0)
    return order


@dataclass(frozen=True)
class Standing:
    counter: float
    weight: float
    revision: int | None  # None: no entry yet


class Lanes:
    """A worker's pulls from the tenant lanes of the models it serves."""

    def __init__(self, nc: Client, js: JetStreamContext, settings: Settings) -> None:
        self.nc = nc
        self.js = js
        self.settings = settings
        self.subs: dict[str, JetStreamContext.PullSubscription] = {}  # durable -> bound
        self._kv: KeyValue | None = None
        self.taken: dict[str, int] = {}  # tenant -> lane tasks pulled (for tests and logs)
        self.lifted = 0

    async def counts(self, model: str) -> dict[str, int]:
        """Per-subject counts of every lane of `model` (one request for all its classes);
        bounded as a pull's answer is, so a broker election does not stall the class pulls."""
        info = await asyncio.wait_for(self.js.stream_info(
            subjects.TASKS_STREAM, subjects_filter=subjects.lane(model, "*", "*")),
            LOOKUP_BUDGET_S)
        return dict(info.state.subjects or {})

    async def pull(self, model: str, priority: str, wanted: int,
                   counts: Mapping[str, int]) -> list[Msg]:
        """Up to `wanted` tasks of `model`'s `priority` lanes, fairest tenant first; never
        raises (a lane that fails is skipped and bound again at its next turn)."""
        lanes = backlog(counts, priority)
        if wanted <= 0 or not lanes:
            return []
        try:
            standing = await self._standing(model, priority, lanes)
        except Exception as exc:  # the counters unread: serve the lanes by name, not none
            log.warning("fair counters of %s's %s lanes not read: %s", model, priority, exc)
            standing = {}
        counters = {t: s.counter for t, s in standing.items()}
        for tenant, counter in lifts(counters, lanes).items():
            if await self._lift(f"{model}.{priority}.{tenant}", counter, standing[tenant]):
                counters[tenant] = counter
        weights = {t: s.weight for t, s in standing.items()}
        got: list[Msg] = []
        while len(got) < wanted and lanes:
            tenant = fair_order(counters, weights, lanes, 1)[0]
            try:
                msgs = await pull_now(await self._bound(model, priority, tenant), 1)
            except Exception as exc:
                log.warning("lane %s of %s's %s class not pulled: %s", tenant, model, priority,
                            type(exc).__name__ + f" {exc}".rstrip())
                self.subs.pop(subjects.lane_durable(model, priority, tenant), None)
                msgs = []
            if not msgs:  # its tasks all running (stored until acked), or none left
                del lanes[tenant]
                continue
            got += msgs
            self.taken[tenant] = self.taken.get(tenant, 0) + len(msgs)
            counters[tenant] = counters.get(tenant, 0.0) + ESTIMATE / weights.get(tenant, 1.0)
        return got

    async def _standing(self, model: str, priority: str,
                        lanes: Iterable[str]) -> dict[str, Standing]:
        kv = await self._bucket()
        standing: dict[str, Standing] = {}
        for tenant in lanes:
            try:
                entry = await kv.get(f"{model}.{priority}.{tenant}")
            except KeyNotFoundError:
                standing[tenant] = Standing(0.0, 1.0, None)
                continue
            share = TenantShare.model_validate_json(entry.value or b"")
            standing[tenant] = Standing(share.counter, share.weight, entry.revision)
        return standing

    async def _lift(self, key: str, counter: float, was: Standing) -> bool:
        """Raise one counter to `counter` unless the entry changed since it was read (then
        the next pull reads it again)."""
        kv = await self._bucket()
        try:
            if was.revision is None:
                new = TenantShare(counter=counter, waiting=0, at=0.0)
                await kv.create(key, new.model_dump_json().encode())
            else:
                entry = await kv.get(key)
                if entry.revision != was.revision:
                    return False
                mine = TenantShare.model_validate_json(entry.value or b"")
                new = mine.model_copy(update={"counter": max(mine.counter, counter)})
                await kv.update(key, new.model_dump_json().encode(), last=was.revision)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            return False
        except Exception as exc:
            log.warning("lane %s not lifted: %s", key, exc)
            return False
        self.lifted += 1
        log.info("lane %s was more than %.0f behind the others: its counter raised to %.0f",
                 key, CREDIT, counter)
        return True

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.key_value(FAIRNESS)
        return self._kv

    async def _bound(self, model: str, priority: str,
                     tenant: str) -> JetStreamContext.PullSubscription:
        name = subjects.lane_durable(model, priority, tenant)
        if (sub := self.subs.get(name)) is not None:
            return sub
        config = consumer_definition(model, self.settings.max_deliver,
                                     self.settings.ack_wait_s, priority)
        config.update(durable_name=name, filter_subject=subjects.lane(model, priority, tenant),
                      description=f"tenant {tenant}'s lane of {model}'s {priority} tasks",
                      inactive_threshold=int(INACTIVE_S * 1e9))
        created = await jetstream_api(
            self.nc, f"CONSUMER.CREATE.{subjects.TASKS_STREAM}.{name}",
            {"stream_name": subjects.TASKS_STREAM, "config": config},
            budget_s=LOOKUP_BUDGET_S)
        if "error" in created:
            raise RuntimeError(f"lane {name}: {created['error'].get('description')}")
        sub = await self.js.pull_subscribe_bind(name, stream=subjects.TASKS_STREAM)
        self.subs[name] = sub
        return sub

    async def close(self) -> None:
        for sub in self.subs.values():
            try:
                await sub.unsubscribe()
            except Exception as exc:  # closing anyway
                log.debug("lane subscription not unsubscribed: %s", exc)
        self.subs.clear()
