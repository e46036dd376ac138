"""KV calls under the broker retry policy (fleet.bus.retry): each one outlasts a restart or an
election, then fails as BrokerUnavailable naming the bucket and key.

Which calls are safe to repeat, and why:
- `kv_put` writes the same value again: the key ends with that value either way.
- `kv_create` may find its own first attempt stored (the answer was lost): a retry then sees
  "key exists". It returns None in that case, like any other "someone has it": the caller
  reads the key if it must know whose it is.
- `kv_update` is a compare-and-set on a revision: a lost answer to a stored update makes the
  retry fail as a wrong revision, reported as None (the caller re-reads and decides again).
- `kv_get` and `kv_delete` are naturally repeatable.
- `put_with_ttl` writes the same value again, with the same per-message TTL; `get_direct`
  and `get_from_leader` read.
- `open_bucket`, `bucket_max_age` and `stream_exists` only read a stream's info.

A write the server refuses by permission fails at once as NotPermitted (fleet.bus.denials).
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from fleet.bus.denials import refused_by_permission
from fleet.bus.retry import BROKER_BUDGET_S, StaleRead, with_retry


async def kv_get(
    kv: KeyValue, key: str, *, budget_s: float = BROKER_BUDGET_S
) -> KeyValue.Entry | None:
    """The key's live entry; None when absent, deleted, purged or expired by TTL (whose
    marker comes back as an entry without a value)."""

    async def once() -> KeyValue.Entry | None:
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):  # absent, or a delete or purge marker
            return None
        return entry if entry.value else None

    return await with_retry(once, what=f"read {kv._name}/{key}", budget_s=budget_s)


async def kv_put(kv: KeyValue, key: str, value: bytes, *, budget_s: float = BROKER_BUDGET_S) -> int:
    """Write the key; its new revision."""
    return await with_retry(
        lambda: refused_by_permission(lambda: kv.put(key, value), _subject(kv, key)),
        what=f"write {kv._name}/{key}", budget_s=budget_s,
    )


async def kv_create(
    kv: KeyValue, key: str, value: bytes, *, budget_s: float = BROKER_BUDGET_S
) -> int | None:
    """Create the key only if it has no live value; its revision, or None when it exists."""

    async def once() -> int | None:
        try:
            return await refused_by_permission(lambda: kv.create(key, value), _subject(kv, key))
        except KeyWrongLastSequenceError:
            return None
        except KeyNotFoundError as exc:
            # nats-py's create, refused because the key has a last message, reads the key to
            # tell a deleted one (re-created in place) from a live one; a replica behind its
            # leader answers "not found" (an R3 cluster with a paused server: a worker died at
            # start of it). Only a fresh look tells which.
            raise StaleRead(f"{kv._name}/{key}: refused as existing, then read as absent") from exc

    return await with_retry(once, what=f"create {kv._name}/{key}", budget_s=budget_s)


async def kv_update(
    kv: KeyValue, key: str, value: bytes, last: int, *, budget_s: float = BROKER_BUDGET_S
) -> int | None:
    """Write the key only if its revision is still `last`; the new revision, or None when
    someone else wrote it first (re-read and decide again)."""

    async def once() -> int | None:
        try:
            return await refused_by_permission(
                lambda: kv.update(key, value, last=last), _subject(kv, key))
        except KeyWrongLastSequenceError:
            return None

    return await with_retry(once, what=f"update {kv._name}/{key}", budget_s=budget_s)


async def kv_delete(kv: KeyValue, key: str, *, budget_s: float = BROKER_BUDGET_S) -> None:
    await with_retry(
        lambda: refused_by_permission(lambda: kv.delete(key), _subject(kv, key)),
        what=f"delete {kv._name}/{key}", budget_s=budget_s,
    )


async def open_bucket(js: JetStreamContext, bucket: str, *,
                      budget_s: float = BROKER_BUDGET_S) -> KeyValue:
    """The bucket (BucketNotFoundError, not retried, when it was never provisioned)."""
    return await with_retry(lambda: js.key_value(bucket), what=f"open bucket {bucket}",
                            budget_s=budget_s)


async def bucket_max_age(js: JetStreamContext, bucket: str, *,
                         budget_s: float = BROKER_BUDGET_S) -> float | None:
    """How long the bucket keeps a key nobody rewrites (its stream's max age); None: for ever."""
    info = await with_retry(lambda: js.stream_info(f"KV_{bucket}"),
                            what=f"read bucket {bucket}", budget_s=budget_s)
    return float(info.config.max_age) if info.config.max_age else None


async def stream_exists(js: JetStreamContext, stream: str, *,
                        budget_s: float = BROKER_BUDGET_S) -> bool:
    """Whether the stream (a bucket's: `KV_<name>`, `OBJ_<name>`) is provisioned."""
    try:
        await with_retry(lambda: js.stream_info(stream), what=f"read stream {stream}",
                         budget_s=budget_s)
    except NotFoundError:
        return False
    return True


async def put_with_ttl(js: JetStreamContext, bucket: str, key: str, value: bytes, ttl_s: int,
                       *, budget_s: float = BROKER_BUDGET_S) -> int:
    """Write the key to live `ttl_s` seconds (`Nats-TTL`, on a bucket that allows per-message
    TTLs, so one bucket keeps keys for different times); its new revision."""
    subject = f"$KV.{bucket}.{key}"
    headers = {"Nats-TTL": f"{ttl_s}s"}

    async def once() -> int:
        ack = await refused_by_permission(
            lambda: js.publish(subject, value, headers=headers), subject)
        return int(ack.seq)

    return await with_retry(once, what=f"write {bucket}/{key}", budget_s=budget_s)


async def get_direct(js: JetStreamContext, bucket: str, key: str, *,
                     budget_s: float = BROKER_BUDGET_S) -> bytes | None:
    """The key's value by a direct get (any replica answers); None when absent, deleted or
    expired."""
    return await _get_value(js, bucket, key, direct=True, budget_s=budget_s)


async def get_from_leader(js: JetStreamContext, bucket: str, key: str, *,
                          budget_s: float = BROKER_BUDGET_S) -> bytes | None:
    """The key's value as its stream's leader holds it (`STREAM.MSG.GET`); None when absent,
    deleted or expired. For a read that must see a write acknowledged a moment ago: the
    bucket allows direct gets, so nats-py's `KeyValue.get` (and `get_direct`) is answered
    by any replica, which in a cluster can be one that has not applied the write yet (CI:
    a placement on a node whose heartbeat the caller had just read found no node)."""
    return await _get_value(js, bucket, key, direct=False, budget_s=budget_s)


async def _get_value(js: JetStreamContext, bucket: str, key: str, *, direct: bool,
                     budget_s: float) -> bytes | None:
    async def once() -> bytes | None:
        try:
            stored = await js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}",
                                      direct=direct)
        except NotFoundError:
            return None
        return stored.data or None  # a delete, purge or TTL marker has no value

    return await with_retry(once, what=f"read {bucket}/{key}", budget_s=budget_s)


def _subject(kv: KeyValue, key: str) -> str:
    """The subject a write of `key` is published on (nats-py's prefix: `$KV.<bucket>.`)."""
    return f"{kv._pre}{key}"
