"""Reading every live entry of a KV bucket at once, without nats-py's `KeyValue.keys()`.

`keys()` stops listing at its first "nothing more pending" marker, which it decides from the
consumer info it asks for right after subscribing: when the server has already pushed the
entries but the client has not handled them yet, the info says nothing is pending, the marker
comes first, and the listing is empty (about 2 listings in 100 here). CI saw it: `fleet up`
did not find its own node, registered milliseconds earlier, and exited.

Here a pull consumer takes the snapshot instead: the server counts the last message of every
key when it creates the consumer (nothing is delivered before the first fetch, so the count
cannot race), and the reader fetches exactly that many, in batches. Delete and purge markers
of removed keys stay in a bucket without a max age, so they are fetched too and skipped; one
fetch carries hundreds of them, where a get per key would pay a round trip each.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from pydantic import BaseModel

from fleet.bus.retry import BROKER_BUDGET_S, with_retry
from fleet.wire.codec import DecodeError, decode_model

Model = TypeVar("Model", bound=BaseModel)

FETCH_BATCH = 512
FETCH_TIMEOUT_S = 5.0
REMOVED = {"DEL", "PURGE"}  # KV-Operation of a removed key


@dataclass(frozen=True)
class LiveEntry:
    key: str
    value: bytes
    revision: int  # the stream sequence, for a compare-and-set update


async def live_entries(
    js: JetStreamContext, bucket: str, *, budget_s: float = BROKER_BUDGET_S
) -> list[LiveEntry]:
    """The current value of every key that has one, as of the call. A restart or an election
    midway is retried with a fresh snapshot (fleet.bus.retry)."""
    return await with_retry(
        lambda: _snapshot(js, bucket), what=f"read bucket {bucket}", budget_s=budget_s
    )


async def _snapshot(js: JetStreamContext, bucket: str) -> list[LiveEntry]:
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    consumer = await js.add_consumer(stream, api.ConsumerConfig(
        filter_subject=f"{prefix}>",
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        inactive_threshold=30.0,  # the server removes it even if this client vanishes
        mem_storage=True,
    ))
    assert consumer.name is not None
    remaining = consumer.num_pending or 0
    found: list[LiveEntry] = []
    sub = await js.pull_subscribe_bind(consumer=consumer.name, stream=stream)
    try:
        while remaining > 0:
            messages = await sub.fetch(min(remaining, FETCH_BATCH), timeout=FETCH_TIMEOUT_S)
            remaining -= len(messages)
            for msg in messages:
                headers = msg.headers or {}
                # A marker the server writes when a key's TTL or max age ends has no value.
                if headers.get("KV-Operation") in REMOVED or not msg.data:
                    continue
                found.append(LiveEntry(
                    key=msg.subject[len(prefix):], value=msg.data,
                    revision=msg.metadata.sequence.stream,
                ))
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(NatsError):
            await js.delete_consumer(stream, consumer.name)
    return sorted(found, key=lambda entry: entry.key)


async def live_values(
    js: JetStreamContext, bucket: str, model: type[Model], *, budget_s: float = BROKER_BUDGET_S
) -> list[Model]:
    """The decoded values of every live key; a value that does not decode is skipped (a writer
    of another schema version must not blind the readers to the rest)."""
    found = []
    for entry in await live_entries(js, bucket, budget_s=budget_s):
        try:
            found.append(decode_model(model, entry.value))
        except DecodeError:
            continue
    return found
