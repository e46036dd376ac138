"""Fair tenants for tasks published straight on NATS: the worker that ends such a task
charges the tokens it served to its tenant's entry in KV FLEET_FAIRNESS (the entry a gateway's
fair turn reads, fleet.gateway.fair_share), so a tenant that floods through NATS is ahead by
what it was served, and its requests through any gateway wait their turn behind the others.

What this is not: an admission point. A task published on NATS is in the broker's queue
already, which hands a class's tasks out in publish order; the worker pulls only what its
free slots can run, so it has no line of its own to reorder by the tenants' counters (see
README, "Priorities and fair tenants"). Only the charge is kept, by the same rule: tokens
served (prompt + completion) over the tenant's weight, the weight the gateways last wrote in
the entry (1 for a tenant no gateway has seen). The entry's `waiting` and `at` are not
touched: they are the gateways' record of requests they admitted.

A task a gateway published carries CHARGED_HEADER (its fair turn charges it), and a task
without a `tenant` belongs to no tenant: neither is charged here. The tenant is the task's
own field, as trusted as whoever may publish on `fleet.tasks.>`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.bus.fairness import tenant_token
from fleet.bus.roles import FAIRNESS
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task
from fleet.wire.events import TaskFinished
from fleet.wire.fairness import CHARGED_HEADER, TenantShare

log = logging.getLogger(__name__)

WRITES = 8  # compare-and-set attempts before a charge is given up (logged)


@dataclass(frozen=True)
class Charge:
    key: str  # `<model>.<class>.<tenant>` in FLEET_FAIRNESS
    tokens: int


def charge_of(subject: str, headers: dict[str, str] | None, data: bytes,
              finished: TaskFinished) -> Charge | None:
    """What to charge for a task this worker ended (pure): None for a gateway's task (it
    charges its own), a task with no tenant or a message that does not decode, and a task
    that served nothing."""
    if (headers or {}).get(CHARGED_HEADER):
        return None
    usage = finished.usage
    tokens = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
    if tokens <= 0:
        return None
    try:
        task = decode_task(data)
    except DecodeError:
        return None
    if task.tenant is None:
        return None
    priority = subjects.priority_of_task_subject(subject)  # the class it was served in
    return Charge(f"{task.model}.{priority}.{tenant_token(task.tenant)}", tokens)


def charged(mine: TenantShare, tokens: int) -> TenantShare:
    """The entry after `tokens` more were served to its tenant outside any gateway (pure)."""
    return mine.model_copy(update={"counter": mine.counter + tokens / mine.weight})


class FairCharges:
    """Charges NATS-published tasks' served tokens; the bucket is opened on first use."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: KeyValue | None = None
        self.charged = 0  # tasks charged (for tests and logs)

    async def after(self, msg: Msg | None, finished: TaskFinished) -> None:
        """Charge the task of `msg` if it is one to charge; NATS trouble loses the charge
        (logged), never the task: its terminal is stored and acked already."""
        if msg is None:
            return
        charge = charge_of(msg.subject, msg.headers, msg.data, finished)
        if charge is None:
            return
        try:
            await self.add(charge)
        except Exception as exc:
            log.warning("task %s: %d tokens not charged to %s: %s", finished.task_id,
                        charge.tokens, charge.key, exc)

    async def add(self, charge: Charge) -> None:
        if self._kv is None:
            self._kv = await self.js.key_value(FAIRNESS)
        kv = self._kv
        for _ in range(WRITES):
            try:
                entry = await kv.get(charge.key)
            except KeyNotFoundError:
                new = charged(TenantShare(counter=0.0, waiting=0, at=0.0), charge.tokens)
                try:
                    await kv.create(charge.key, new.model_dump_json().encode())
                except KeyWrongLastSequenceError:
                    continue  # created meanwhile: read it again
            else:
                mine = TenantShare.model_validate_json(entry.value or b"")
                new = charged(mine, charge.tokens)
                try:
                    await kv.update(charge.key, new.model_dump_json().encode(),
                                    last=entry.revision)
                except KeyWrongLastSequenceError:
                    continue
            self.charged += 1
            return
        log.warning("%d tokens not charged to %s: %d writes raced", charge.tokens, charge.key,
                    WRITES)
