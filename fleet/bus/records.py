"""Typed records in the KV buckets the worker reads and writes: who owns a task id
(FLEET_CLAIMS), which tasks were cancelled (FLEET_CANCELS), where instances are placed
(FLEET_INSTANCES), this node's heartbeat (FLEET_NODES) and its runners (FLEET_RUNNERS). Callers
speak of task ids, owners and the wire types; the keys and the encoding stay here. Every call
goes through fleet.bus.kv_calls, with its own retry budget (fleet.bus.retry).

Why a claim or a cancel is written (and when a claim is judged fresh, own or taken) is the
worker's (fleet.worker.claims); these classes only keep the records.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from fleet.bus.connect import publish
from fleet.bus.kv_calls import kv_create, kv_delete, kv_get, kv_put, kv_update, open_bucket
from fleet.bus.retry import BROKER_BUDGET_S, with_retry
from fleet.errors import ProvisioningConflict
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo, RunnerRecord
from fleet.wire.codec import decode_model, encode
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

    def __init__(self, kv: KeyValue, nc: Client, *, budget_s: float = BROKER_BUDGET_S) -> None:
        self.kv = kv
        self.nc = nc  # the announcements' connection
        self.budget_s = budget_s

    @classmethod
    async def open(cls, js: JetStreamContext, *, budget_s: float = BROKER_BUDGET_S
                   ) -> CancelRecords:
        """Over the connection `js` was made from (nats-py keeps it as `_nc`)."""
        return cls(await open_bucket(js, subjects.CANCELS_BUCKET, budget_s=budget_s),
                   js._nc, budget_s=budget_s)

    async def record(self, cancel: CancelTask) -> None:
        await kv_put(self.kv, cancel.task_id, encode(cancel), budget_s=self.budget_s)

    async def send(self, cancel: CancelTask) -> None:
        """Record the cancel, then announce it on `fleet.cancel.<id>` (the worker running the
        task hears it at once; one that fetches it later finds the record): the one way a
        cancel is sent, by the gateway and `fleet cancel`. The announcement is a core publish,
        retried only while the connection is reconnecting (a lost one costs nothing: the
        record stands, and the workers watch the bucket too)."""
        await self.record(cancel)
        await with_retry(lambda: publish(self.nc, subjects.cancel(cancel.task_id), cancel),
                         what=f"announce the cancel of {cancel.task_id}",
                         budget_s=self.budget_s)

    async def cancelled(self, task_id: str) -> bool:
        return await kv_get(self.kv, task_id, budget_s=self.budget_s) is not None


class InstanceRecords:
    """FLEET_INSTANCES: instance id -> its Instance. Every write is a compare-and-set (a
    create, or an update on the revision read), so workers racing to place or move one
    instance leave one answer."""

    def __init__(self, kv: KeyValue, *, budget_s: float = BROKER_BUDGET_S) -> None:
        self.kv = kv
        self.budget_s = budget_s

    async def get(self, instance_id: str) -> tuple[Instance, int] | None:
        """The instance and its revision; None when it is not placed (DecodeError when its
        value is not an Instance)."""
        entry = await kv_get(self.kv, instance_id, budget_s=self.budget_s)
        if entry is None or not entry.value:
            return None
        return decode_model(Instance, entry.value), int(entry.revision or 0)

    async def create(self, instance: Instance) -> bool:
        """Place it; False when an instance of that id exists (someone placed it first)."""
        return await kv_create(self.kv, instance.instance_id, encode(instance),
                               budget_s=self.budget_s) is not None

    async def update(self, instance: Instance, last: int) -> bool:
        """Replace it if its revision is still `last`; False when someone wrote it first."""
        return await kv_update(self.kv, instance.instance_id, encode(instance), last,
                               budget_s=self.budget_s) is not None

    async def delete(self, instance_id: str) -> None:
        await kv_delete(self.kv, instance_id, budget_s=self.budget_s)


class NodeRecords:
    """FLEET_NODES: node id -> its NodeInfo, re-put as a heartbeat (the bucket's max age
    removes a silent node)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def put(self, info: NodeInfo, *, budget_s: float = BROKER_BUDGET_S) -> None:
        await kv_put(self.kv, info.node_id, encode(info), budget_s=budget_s)

    async def delete(self, node_id: str, *, budget_s: float = BROKER_BUDGET_S) -> None:
        await kv_delete(self.kv, node_id, budget_s=budget_s)


class RunnerRecords:
    """FLEET_RUNNERS: runner id -> its RunnerRecord (status, slots, tasks)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def put(self, record: RunnerRecord, *, budget_s: float = BROKER_BUDGET_S) -> None:
        await kv_put(self.kv, record.runner_id, encode(record), budget_s=budget_s)

    async def delete(self, runner_id: str, *, budget_s: float = BROKER_BUDGET_S) -> None:
        await kv_delete(self.kv, runner_id, budget_s=budget_s)
