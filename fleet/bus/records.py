"""Typed records in the KV buckets a task's path reads and writes: who owns a task id
(FLEET_CLAIMS) and which tasks were cancelled (FLEET_CANCELS). Callers speak of task ids,
owners and CancelTask; the bucket, its keys and its values stay here. Every call goes through
fleet.bus.kv_calls, with its own retry budget (fleet.bus.retry).

Why a claim or a cancel is written (and when a claim is judged fresh, own or taken) is the
worker's (fleet.worker.claims); these classes only keep the records.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from fleet.bus.kv_calls import kv_create, kv_get, kv_put, open_bucket
from fleet.bus.retry import BROKER_BUDGET_S
from fleet.errors import ProvisioningConflict
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.tasks import CancelTask


async def _provisioned(js: JetStreamContext, bucket: str) -> KeyValue:
    try:
        return await open_bucket(js, bucket)
    except BucketNotFoundError:
        raise ProvisioningConflict(
            f"KV bucket {bucket} is missing (ops/jetstream/KV_{bucket}.json): "
            "run `fleet nats --provision` as the operator"
        ) from None


class ClaimRecords:
    """FLEET_CLAIMS: task id -> the owner that claimed it (a stream sequence, a one-off token,
    or a `used-` mark)."""

    def __init__(self, kv: KeyValue, *, budget_s: float = BROKER_BUDGET_S) -> None:
        self.kv = kv
        self.budget_s = budget_s

    @classmethod
    async def open(cls, js: JetStreamContext) -> ClaimRecords:
        return cls(await _provisioned(js, subjects.CLAIMS_BUCKET))

    async def create(self, task_id: str, owner: str) -> bool:
        """Claim the id for `owner`; False when it is held (by anyone, this owner included:
        a create retried after a lost answer finds its own claim)."""
        return await kv_create(self.kv, task_id, owner.encode(),
                               budget_s=self.budget_s) is not None

    async def holder(self, task_id: str) -> str | None:
        """Who holds the id; None when nobody does (never claimed, purged or expired)."""
        entry = await kv_get(self.kv, task_id, budget_s=self.budget_s)
        return entry.value.decode() if entry is not None and entry.value else None

    async def hold(self, task_id: str, owner: str) -> None:
        """Give the id to `owner` whoever held it (a `used-` mark: nobody may own it)."""
        await kv_put(self.kv, task_id, owner.encode(), budget_s=self.budget_s)


class CancelRecords:
    """FLEET_CANCELS: task id -> its CancelTask, so a cancel sent before a worker fetched the
    task is honoured when it does (the bucket keeps them an hour)."""

    def __init__(self, kv: KeyValue, *, budget_s: float = BROKER_BUDGET_S) -> None:
        self.kv = kv
        self.budget_s = budget_s

    @classmethod
    async def open(cls, js: JetStreamContext, *, budget_s: float = BROKER_BUDGET_S
                   ) -> CancelRecords:
        return cls(await open_bucket(js, subjects.CANCELS_BUCKET, budget_s=budget_s),
                   budget_s=budget_s)

    async def record(self, cancel: CancelTask) -> None:
        await kv_put(self.kv, cancel.task_id, encode(cancel), budget_s=self.budget_s)

    async def cancelled(self, task_id: str) -> bool:
        return await kv_get(self.kv, task_id, budget_s=self.budget_s) is not None
