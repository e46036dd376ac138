"""Which tenant owns a task id or an image, kept in the KV bucket FLEET_TENANTS.

The gateway writes `task.<task_id>` = a TaskRecord (tenant, the API asked, an n > 1 request's
choices) before it publishes a task, open gateway or not (kept 1 h, as long as FLEET_OUT keeps
the task's events) and `image.<sha256>.<tenant>` for every image a tenant's tasks produced or
that it sent (kept 7 d, as long as FLEET_IMAGES keeps images). Per-message TTLs (`Nats-TTL`)
let one bucket keep both for their own time.

Another tenant's task or image reads exactly like one that does not exist (404): answering
403 would confirm the id. An open gateway (no API keys) has no tenants and checks nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.aio.client import Client
from nats.errors import Error as NatsError

from fleet.bus.kv_calls import get_direct, put_with_ttl
from fleet.errors import FleetError, NatsUnavailable
from fleet.wire.codec import DecodeError, decode_model, encode
from fleet.wire.records import TaskRecord

log = logging.getLogger(__name__)


TENANTS_BUCKET = "FLEET_TENANTS"


STREAM = f"KV_{TENANTS_BUCKET}"


TASK_TTL_S = 3600


IMAGE_TTL_S = 7 * 24 * 3600


def task_key(task_id: str) -> str:
    return f"task.{task_id}"


def image_key(sha256: str, tenant: str) -> str:
    return f"image.{sha256}.{tenant}"


def subject_of(key: str) -> str:
    return f"$KV.{TENANTS_BUCKET}.{key}"


def record_of(value: bytes, task_id: str) -> TaskRecord | None:
    """The record stored for a task; one that cannot be read owns nothing (logged)."""
    try:
        return decode_model(TaskRecord, value)
    except DecodeError as exc:
        log.warning("the record of task %s in %s is unreadable: %s", task_id, TENANTS_BUCKET, exc)
        return None


class Owners:
    """Ownership records over one NATS connection (`client()` raises while it is down)."""

    def __init__(self, client: Callable[[], Client]) -> None:
        self._client = client

    def _nc(self) -> Client:
        return self._client()

    async def _put(self, key: str, value: bytes, ttl_s: int) -> None:
        js = self._nc().jetstream()
        try:
            # The broker's whole budget, as every other call has: a KV election (4-8 s)
            # must delay the request, not fail it.
            await put_with_ttl(js, TENANTS_BUCKET, key, value, ttl_s)
        except FleetError:
            raise
        except (NatsError, OSError, TimeoutError) as exc:
            raise NatsUnavailable(f"could not record the owner of {key}: {exc!r}") from None

    async def _get(self, key: str) -> bytes | None:
        js = self._nc().jetstream()
        try:
            return await get_direct(js, TENANTS_BUCKET, key)  # a TTL marker reads as None
        except FleetError:
            raise
        except (NatsError, OSError, TimeoutError) as exc:
            raise NatsUnavailable(f"could not read the owner of {key}: {exc!r}") from None

    async def record_task(self, task_id: str, record: TaskRecord) -> None:
        await self._put(task_key(task_id), encode(record), TASK_TTL_S)

    async def task_record(self, task_id: str) -> TaskRecord | None:
        value = await self._get(task_key(task_id))
        return record_of(value, task_id) if value else None

    async def owns_task(self, task_id: str, tenant: str | None) -> bool:
        if tenant is None:
            return True
        record = await self.task_record(task_id)
        return record is not None and record.tenant == tenant

    async def own_image(self, sha256: str, tenant: str | None) -> None:
        if tenant is not None:
            await self._put(image_key(sha256, tenant), b"1", IMAGE_TTL_S)

    async def owns_image(self, sha256: str, tenant: str | None) -> bool:
        return tenant is None or await self._get(image_key(sha256, tenant)) is not None
