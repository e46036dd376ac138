"""Fair tenants for tasks published straight on NATS: the worker that ends such a task
charges the tokens it served to its tenant's entry in KV FLEET_FAIRNESS (the entry a gateway's
fair turn reads, fleet.gateway.fair_share), so a tenant that floods through NATS is ahead by
what it was served, and its requests through any gateway, and its tenant lane (fleet.worker.
lanes), wait their turn behind the others.

The charge is made before the task's ack and marked by task id, in the same compare-and-set
as the counter (the entry's `settled`, the shape the gateway keeps its batch lines in): a
worker that dies between its charge and its ack leaves the message to be redelivered, and the
worker that takes it finds the terminal stored, charges it again from that terminal (a
no-op when the mark is there, the charge when the first worker died before making it), and
acks it. Once the ack is sent nothing redelivers the task, and the mark is dropped
(`forget`). So a task is charged once whoever ends it; a worker that dies after its ack and
before the forget leaves a mark behind (SETTLED_MAX bounds them). NATS trouble past the
charge's budget loses the charge (logged), never the task: its terminal is stored, and it is
acked without.

The rule is the gateway's: tokens served (prompt + completion) over the tenant's weight, the
weight the gateways last wrote in the entry (1 for a tenant no gateway has seen). The entry's
`waiting` and `at` are not touched: they are the gateways' record of requests they admitted.

A task a gateway published carries CHARGED_HEADER (its fair turn charges it), and a task
without a `tenant` belongs to no tenant: neither is charged here. The tenant is the task's
own field (on a tenant lane, the lane's: what was served there is charged there), as
trusted as whoever may publish on `fleet.tasks.>`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet.bus.fairness import tenant_token
from fleet.bus.retry import with_retry
from fleet.bus.roles import FAIRNESS
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_task
from fleet.wire.events import TaskFinished
from fleet.wire.fairness import CHARGED_HEADER, TenantShare

log = logging.getLogger(__name__)

WRITES = 32  # compare-and-set attempts before a charge is given up (logged): each lost
# race means another writer won, so N concurrent writers need at most N rounds
SETTLED_MAX = 256  # as the gateway's: marks of tasks charged and not yet acked (normally few)
# How long an ending waits for the charge (a broker election) before it acks without it:
# well inside AckWait, so the message is not redelivered meanwhile.
CHARGE_BUDGET_S = 10.0

_Change = Callable[[TenantShare], TenantShare | None]  # an entry's next value, or None


@dataclass(frozen=True)
class Charge:
    key: str  # `<model>.<class>.<tenant>` in FLEET_FAIRNESS
    tokens: int
    task_id: str = ""  # the mark that makes the charge once per task


def charge_of(subject: str, headers: dict[str, str] | None, data: bytes,
              finished: TaskFinished) -> Charge | None:
    """What to charge for a task this worker ended (pure): None for a gateway's task (it
    charges its own), a task with no tenant or a message that does not decode, and a task
    that served nothing. A tenant lane's task is charged to the lane's tenant."""
    if (headers or {}).get(CHARGED_HEADER):
        return None
    usage = finished.usage
    tokens = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
    if tokens <= 0:
        return None
    lane = subjects.tenant_of_task_subject(subject)
    if lane is None and b'"tenant"' not in data:
        # No tenant key, so the decode would find none (only a key spelled with \u escapes
        # would be missed: no encoder writes one). Spares most tasks a second decode.
        return None
    try:
        task = decode_task(data)
    except DecodeError:
        return None
    if lane is None and task.tenant is None:
        return None
    tenant = lane if lane is not None else tenant_token(task.tenant or "")
    priority = subjects.priority_of_task_subject(subject)  # the class it was served in
    return Charge(f"{task.model}.{priority}.{tenant}", tokens, finished.task_id)


def charged(mine: TenantShare, tokens: int) -> TenantShare:
    """The entry after `tokens` more were served to its tenant outside any gateway (pure)."""
    return mine.model_copy(update={"counter": mine.counter + tokens / mine.weight})


def marked(mine: TenantShare, task_id: str, tokens: int) -> TenantShare | None:
    """The entry after task `task_id` was charged `tokens` and marked so (pure); None when
    its mark is there already: charged by an earlier attempt at its ending."""
    if task_id in mine.settled:
        return None
    return charged(mine, tokens).model_copy(
        update={"settled": [*mine.settled, task_id][-SETTLED_MAX:]})


def unmarked(mine: TenantShare, task_id: str) -> TenantShare | None:
    """The entry without `task_id`'s mark (its message is acked; pure); None without one."""
    if task_id not in mine.settled:
        return None
    return mine.model_copy(update={"settled": [k for k in mine.settled if k != task_id]})


class FairCharges:
    """Charges NATS-published tasks' served tokens; the bucket is opened on first use."""

    def __init__(self, js: JetStreamContext, budget_s: float = CHARGE_BUDGET_S) -> None:
        self.js = js
        self.budget_s = budget_s
        self._kv: KeyValue | None = None
        self.charged = 0  # tasks charged (for tests and logs)
        self.found = 0  # charges found made already (an earlier attempt's ending)

    async def before_ack(self, msg: Msg | None, finished: TaskFinished) -> Charge | None:
        """Charge the task of `msg` if it is one to charge, before its ack; the charge made
        (or found made) is returned for `after_ack`. NATS trouble loses the charge (logged),
        never the task: its terminal is stored, and it is acked all the same."""
        if msg is None:
            return None
        charge = charge_of(msg.subject, msg.headers, msg.data, finished)
        if charge is None:
            return None
        try:
            await with_retry(lambda: self.add(charge), what=f"charge of {charge.key}",
                             budget_s=self.budget_s)
        except Exception as exc:
            log.warning("task %s: %d tokens not charged to %s: %s", finished.task_id,
                        charge.tokens, charge.key, exc)
            return None
        return charge

    async def after_ack(self, charge: Charge | None) -> None:
        """The task's message is acked: no attempt will end it again, so its mark goes."""
        if charge is None or not charge.task_id:
            return
        try:
            await with_retry(lambda: self._write(charge, lambda mine: unmarked(
                mine, charge.task_id), create=False), what=f"mark in {charge.key}",
                budget_s=self.budget_s)
        except Exception as exc:
            log.warning("task %s: its charge's mark in %s not dropped: %s", charge.task_id,
                        charge.key, exc)

    async def after(self, msg: Msg | None, finished: TaskFinished) -> None:
        """Charge and drop the mark at once (a caller with no ack between)."""
        await self.after_ack(await self.before_ack(msg, finished))

    async def add(self, charge: Charge) -> None:
        if charge.task_id:
            wrote = await self._write(
                charge, lambda mine: marked(mine, charge.task_id, charge.tokens))
        else:
            wrote = await self._write(charge, lambda mine: charged(mine, charge.tokens))
        if wrote:
            self.charged += 1
        else:
            self.found += 1

    async def _write(self, charge: Charge, change: _Change, create: bool = True) -> bool:
        """Compare-and-set `change` of the entry (None: nothing to write); whether it wrote.
        Raises after WRITES lost races (the caller's budget retries transient errors)."""
        if self._kv is None:
            self._kv = await self.js.key_value(FAIRNESS)
        kv = self._kv
        for _ in range(WRITES):
            try:
                entry = await kv.get(charge.key)
            except KeyNotFoundError:
                if not create:
                    return False
                new = change(TenantShare(counter=0.0, waiting=0, at=0.0))
                if new is None:
                    return False
                try:
                    await kv.create(charge.key, new.model_dump_json().encode())
                except KeyWrongLastSequenceError:
                    continue  # created meanwhile: read it again
                return True
            new = change(TenantShare.model_validate_json(entry.value or b""))
            if new is None:
                return False
            try:
                await kv.update(charge.key, new.model_dump_json().encode(),
                                last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return True
        raise RuntimeError(f"{charge.tokens} tokens not charged to {charge.key}: "
                           f"{WRITES} writes raced")

