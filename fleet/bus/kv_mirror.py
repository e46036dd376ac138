"""A KV bucket mirrored in memory by a watch, with no read per request or tick: the gateway's
catalogue (FLEET_MODELS, FLEET_CAPABILITIES, FLEET_INSTANCES) and the dashboard's feed
(FLEET_NODES, FLEET_INSTANCES, FLEET_RUNNERS, the task owners in FLEET_TENANTS) both keep
theirs this way.

A node leaves FLEET_NODES by its key's max age; the bucket has `limit_marker_ttl`, so the
server then writes a purge marker that a watcher sees (nats-py reads its Nats-Marker-Reason
as PURGE). A watch is an ordered push consumer; after a reconnect it is started afresh and
its initial values replace the mirror whole, so a key removed during the outage goes too.
Measured (tests/dashboard/test_dashboard_feed.py): after a server restart nats-py's own
ordered consumer did not deliver again within 30 s; a fresh watch does at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout

log = logging.getLogger(__name__)

REMOVED = {"DEL", "PURGE"}
RECONNECT_CHECK_S = 2.0  # how often a quiet watch checks that its connection is the same
WAIT_CONNECTED_S = 0.5


class Connection(Protocol):
    """What a mirror needs of its owner's connection (the gateway's Backend is one)."""

    @property
    def nc(self) -> Client | None: ...

    @property
    def connected(self) -> bool: ...


def apply_entry(
    values: dict[str, bytes], key: str, operation: str | None, value: bytes | None,
    limit: int | None = None,
) -> bool:
    """Fold one watched entry into `values`; whether the mirror changed. A delete, a purge and
    a TTL marker (an entry without a value) remove the key. With `limit`, the oldest key
    inserted goes first when there are more."""
    if operation in REMOVED or not value:
        return values.pop(key, None) is not None
    if values.get(key) == value:
        return False
    values[key] = value
    while limit is not None and len(values) > limit:
        del values[next(iter(values))]
    return True


class Mirror:
    """The live keys of one bucket under `keys`; `on_change(key)` after each change once the
    first values are in (`key` None: the whole mirror was replaced)."""

    def __init__(
        self, bucket: str, on_change: Callable[[str | None], None], *, keys: str = ">",
        limit: int | None = None,
    ) -> None:
        self.bucket, self.keys, self.limit = bucket, keys, limit
        self.on_change = on_change
        self.values: dict[str, bytes] = {}
        self.ready = asyncio.Event()

    async def run(self, backend: Connection) -> None:
        """Until cancelled (a Supervisor child): one watch per connection."""
        while True:
            while not backend.connected:
                await asyncio.sleep(WAIT_CONNECTED_S)  # the backend reconnects by itself
            await self._watch_once(backend)
            log.info("NATS reconnected; watching %s afresh", self.bucket)

    async def _watch_once(self, backend: Connection) -> None:
        nc = backend.nc
        assert nc is not None
        reconnects = nc.stats["reconnects"]
        kv = await nc.jetstream().key_value(self.bucket)
        watcher = await kv.watch(self.keys)
        fresh: dict[str, bytes] | None = {}  # the watch's initial values, until all are in
        try:
            while backend.nc is nc and nc.stats["reconnects"] == reconnects:
                try:
                    entry = await watcher.updates(timeout=RECONNECT_CHECK_S)
                except NatsTimeout:
                    continue
                if entry is None:  # the marker after the initial values
                    if fresh is not None:
                        self.values, fresh = fresh, None
                        self.ready.set()
                        self.on_change(None)
                    continue
                target = self.values if fresh is None else fresh
                if apply_entry(target, entry.key, entry.operation, entry.value, self.limit) \
                        and fresh is None:
                    self.on_change(entry.key)
        finally:
            with contextlib.suppress(NatsError):  # the connection may be gone already
                await watcher.stop()
