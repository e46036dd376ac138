"""Batch jobs in NATS, shared by every gateway: files (object store FLEET_FILES plus a record
each in KV FLEET_BATCHES), batch records (KV FLEET_BATCHES, compare-and-set), the job leases
(KV FLEET_BATCH_LEASES) and one result per request line (stream FLEET_BATCH_RESULTS, one
message a subject). Errors leave as Fleet errors (NatsUnavailable and friends)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from fleet.bus.connect import js_publish
from fleet.bus.kv_calls import kv_create, kv_get, kv_put, kv_update
from fleet.bus.kv_read import live_entries
from fleet.bus.objects import ObjectBucket
from fleet.errors import FleetError, NatsUnavailable, ObjectError
from fleet.wire.batches import BatchLease, BatchRecord, BatchResult, FileRecord
from fleet.wire.codec import DecodeError, decode_model, encode

log = logging.getLogger(__name__)

FILES_BUCKET = "FLEET_FILES"
BATCHES_BUCKET = "FLEET_BATCHES"
LEASES_BUCKET = "FLEET_BATCH_LEASES"
IDEMPOTENCY_BUCKET = "FLEET_IDEMPOTENCY"
RESULTS_STREAM = "FLEET_BATCH_RESULTS"
# JetStream's answer to a second message on a subject that keeps one (DiscardNewPerSubject).
PER_SUBJECT_FULL = 10077
READ_TIMEOUT_S = 10.0  # the silence allowed between two results of a read

M = TypeVar("M", bound=BaseModel)


def result_subject(batch_id: str, line: int) -> str:
    return f"fleet.batches.{batch_id}.{line}"


def results_of(batch_id: str) -> str:
    return f"fleet.batches.{batch_id}.>"


@contextlib.contextmanager
def unavailable(doing: str) -> Iterator[None]:
    try:
        yield
    except FleetError:
        raise
    except (NatsError, OSError, TimeoutError) as exc:
        raise NatsUnavailable(f"NATS could not {doing}: {exc!r}") from None


class BatchStore:
    def __init__(self, client: Callable[[], Client]) -> None:
        """`client()` gives the live connection (or raises NatsUnavailable)."""
        self._client = client
        self._kv: dict[str, KeyValue] = {}

    async def bucket(self, name: str) -> KeyValue:
        if name not in self._kv:
            with unavailable(f"open bucket {name}"):
                self._kv[name] = await self._client().jetstream().key_value(name)
        return self._kv[name]

    def _files(self) -> ObjectBucket:
        return ObjectBucket(self._client(), FILES_BUCKET, named_by_hash=False, timeout=10.0)

    async def _read(self, bucket: str, key: str, model: type[M]) -> tuple[M, int] | None:
        kv = await self.bucket(bucket)
        with unavailable(f"read {bucket}/{key}"):
            entry = await kv_get(kv, key)
        if entry is None or entry.value is None:
            return None
        return decode_model(model, entry.value), entry.revision or 0

    # Files

    async def put_file(self, record: FileRecord, data: bytes) -> None:
        """The bytes first, then the record: a file is listed only once it can be read."""
        try:
            if await self._files().find(record.id) is None:
                await self._files().put(record.id, data)
        except ObjectError as exc:
            raise NatsUnavailable(f"could not store file {record.id}: {exc.message}") from None
        kv = await self.bucket(BATCHES_BUCKET)
        with unavailable(f"record file {record.id}"):
            await kv_put(kv, f"file.{record.id}", encode(record))

    async def file(self, file_id: str) -> FileRecord | None:
        found = await self._read(BATCHES_BUCKET, f"file.{file_id}", FileRecord)
        return found[0] if found else None

    async def file_bytes(self, file_id: str) -> bytes:
        try:
            return await self._files().get(file_id)
        except ObjectError as exc:
            raise NatsUnavailable(f"could not read file {file_id}: {exc.message}") from None

    async def delete_file(self, file_id: str) -> None:
        kv = await self.bucket(BATCHES_BUCKET)
        with unavailable(f"delete file {file_id}"):
            await kv.purge(f"file.{file_id}")
            store = await self._client().jetstream().object_store(FILES_BUCKET)
            with contextlib.suppress(NotFoundError):
                await store.delete(file_id)

    async def _all(self, prefix: str, model: type[M]) -> list[M]:
        """Every `<prefix>.<id>` record, from one snapshot of the bucket (fleet.bus.kv_read:
        nats-py's keys() can end a listing early)."""
        with unavailable(f"list {BATCHES_BUCKET}"):
            entries = await live_entries(self._client().jetstream(), BATCHES_BUCKET)
        found = []
        for entry in (e for e in entries if e.key.startswith(f"{prefix}.")):
            try:
                found.append(decode_model(model, entry.value))
            except DecodeError:  # another schema version's record must not hide the rest
                log.warning("skipped %s/%s: not a %s", BATCHES_BUCKET, entry.key, model.__name__)
        return found

    async def files(self) -> list[FileRecord]:
        return await self._all("file", FileRecord)

    # Batches

    async def create_batch(self, record: BatchRecord) -> bool:
        kv = await self.bucket(BATCHES_BUCKET)
        with unavailable(f"record batch {record.id}"):
            return await kv_create(kv, f"batch.{record.id}", encode(record)) is not None

    async def batch(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        return await self._read(BATCHES_BUCKET, f"batch.{batch_id}", BatchRecord)

    async def update_batch(self, record: BatchRecord, revision: int) -> int | None:
        """Compare-and-set: the new revision, or None when someone wrote it first."""
        kv = await self.bucket(BATCHES_BUCKET)
        with unavailable(f"update batch {record.id}"):
            return await kv_update(kv, f"batch.{record.id}", encode(record), revision)

    async def batches(self) -> list[BatchRecord]:
        return await self._all("batch", BatchRecord)

    # Leases

    async def lease(self, batch_id: str) -> tuple[BatchLease, int] | None:
        return await self._read(LEASES_BUCKET, batch_id, BatchLease)

    async def create_lease(self, lease: BatchLease) -> int | None:
        kv = await self.bucket(LEASES_BUCKET)
        with unavailable(f"create the lease of {lease.batch_id}"):
            return await kv_create(kv, lease.batch_id, encode(lease))

    async def update_lease(self, lease: BatchLease, revision: int) -> int | None:
        kv = await self.bucket(LEASES_BUCKET)
        with unavailable(f"renew the lease of {lease.batch_id}"):
            return await kv_update(kv, lease.batch_id, encode(lease), revision)

    async def end_lease(self, batch_id: str) -> None:
        kv = await self.bucket(LEASES_BUCKET)
        with unavailable(f"end the lease of {batch_id}"):
            await kv.purge(batch_id)

    async def leased(self) -> list[str]:
        """The ids of the jobs that are not done (each has a lease key)."""
        with unavailable(f"list {LEASES_BUCKET}"):
            return [e.key for e in await live_entries(self._client().jetstream(), LEASES_BUCKET)]

    # Results

    async def record_result(self, result: BatchResult) -> bool:
        """True when stored now; False when the line already had its result."""
        subject = result_subject(result.batch_id, result.line)
        try:
            await js_publish(self._client().jetstream(), subject, result, msg_id=subject)
        except APIError as exc:
            if exc.err_code == PER_SUBJECT_FULL:
                return False
            raise NatsUnavailable(f"JetStream refused the result: {exc.description}") from None
        except FleetError:
            raise
        except (NatsError, OSError, TimeoutError) as exc:
            raise NatsUnavailable(f"could not record the result {subject}: {exc!r}") from None
        return True

    async def results(self, batch_id: str) -> list[BatchResult]:
        """Every result recorded for the job, by line: an ordered consumer (the ephemeral kind
        the gateway role may make) read up to the last result stored when the read began."""
        js = self._client().jetstream()
        found: dict[int, BatchResult] = {}
        with unavailable(f"read the results of {batch_id}"):
            try:
                last = await js.get_last_msg(RESULTS_STREAM, results_of(batch_id))
            except NotFoundError:
                return []
            sub = await js.subscribe(results_of(batch_id), stream=RESULTS_STREAM,
                                     ordered_consumer=True,
                                     deliver_policy=DeliverPolicy.ALL)
            try:
                while True:
                    msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
                    result = decode_model(BatchResult, msg.data)
                    found[result.line] = result
                    if msg.metadata.sequence.stream >= last.seq:
                        break
            finally:
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
        return [found[line] for line in sorted(found)]
