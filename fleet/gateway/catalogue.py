"""The gateway's view of the fleet's models and nodes, kept current by KV watches.

Cards come from KV FLEET_MODELS (so a model added with `fleet models add` on another machine
is known here at once), over the built-in cards and the custom cards of this data dir (read at
start, and again only when a request names a model no card knows). The nodes' heartbeats
(FLEET_NODES) say which models some node can provide, FLEET_INSTANCES which are placed (and so
served, or about to be). Requests read all three from memory: no disk or KV read per request.

The watches are children of a Supervisor that lives in a task of its own (a TaskGroup is
entered and left by one task): a watch that fails is logged and restarted with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client
from pydantic import BaseModel

from fleet.aio import DetachedSupervisor, Supervisor
from fleet.bus.weights import MODELS_BUCKET
from fleet.errors import FleetError
from fleet.gateway.models_view import unavailable_reason
from fleet.models.catalog import builtin_cards, custom_cards
from fleet.placement import HEARTBEAT_STALE_S
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo
from fleet.wire.codec import DecodeError, decode_model

log = logging.getLogger(__name__)

Model = TypeVar("Model", bound=BaseModel)
CONNECT_POLL_S = 0.2  # how often a watch looks for the backend's first connection


class Catalogue:
    def __init__(self, data_dir: Path, client: Callable[[], Client | None]) -> None:
        self.data_dir = data_dir
        self.client = client  # the backend's connection; None until it is up
        self.local = {**builtin_cards(), **_custom_cards(data_dir)}
        self.fleet: dict[str, ModelCard] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.placed: set[str] = set()  # models with an instance in FLEET_INSTANCES
        self.nodes_loaded = False  # the nodes watch has delivered every current heartbeat
        self.cards_loaded = False
        self._changed = asyncio.Condition()
        self._children = DetachedSupervisor("gateway catalogue", self._add_children)

    # ---- reading (from memory) -----------------------------------------------------------

    def cards(self) -> dict[str, ModelCard]:
        merged = {**self.local, **self.fleet}
        return dict(sorted(merged.items()))

    def card(self, model: str) -> ModelCard | None:
        found = self.fleet.get(model) or self.local.get(model)
        if found is None:
            # A card added to this data dir since (`fleet models add` without NATS): read
            # only for a model no card names, never for the models being served.
            self.local = {**builtin_cards(), **_custom_cards(self.data_dir)}
            found = self.local.get(model)
        return found

    def unavailable(self, card: ModelCard, placed: bool = False) -> str | None:
        """Why no node can serve `card` now; None when one can, or while the nodes are not
        known yet (the gateway just started, or NATS is down: the request path says so)."""
        if not self.nodes_loaded:
            return None
        placed = placed or card.id in self.placed
        return unavailable_reason(card, self.nodes.values(), placed, time.time())

    def refuses(self, card: ModelCard) -> str | None:
        """Why a request for `card` fails at once. With no worker up at all the task waits
        in its queue instead: a worker may be starting, and it is served when it joins."""
        if not any(time.time() - n.at < HEARTBEAT_STALE_S for n in self.nodes.values()):
            return None
        return self.unavailable(card)

    # ---- the watches ---------------------------------------------------------------------

    async def start(self, wait_s: float) -> None:
        """Start the watches; wait up to `wait_s` for their first load, so that a healthy
        start knows the fleet's models before its first request."""
        await self._children.start()
        with contextlib.suppress(TimeoutError):
            await self.until(lambda: self.cards_loaded and self.nodes_loaded, wait_s)

    async def until(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait until `done()` holds after some change (TimeoutError after `timeout`)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(done)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        await self._children.close()

    def _add_children(self, supervisor: Supervisor) -> None:
        supervisor.forever("model cards watch", self._watch_cards)
        supervisor.forever("nodes watch", self._watch_nodes)
        supervisor.forever("instances watch", self._watch_instances)

    async def _watch_cards(self) -> None:
        try:
            async for cards in self._watch(MODELS_BUCKET, ModelCard):
                self.fleet = {card.id: card for card in cards.values()}
                self.cards_loaded = True
                await self._notify()
        finally:
            self.cards_loaded = False

    async def _watch_nodes(self) -> None:
        try:
            async for nodes in self._watch(subjects.NODES_BUCKET, NodeInfo):
                self.nodes = nodes
                self.nodes_loaded = True
                await self._notify()
        finally:
            self.nodes_loaded = False  # stale until the restarted watch has loaded again

    async def _watch_instances(self) -> None:
        try:
            async for instances in self._watch(subjects.INSTANCES_BUCKET, Instance):
                self.placed = {instance.model for instance in instances.values()}
                await self._notify()
        finally:
            self.placed = set()

    async def _watch(self, bucket: str, model: type[Model]) -> AsyncIterator[dict[str, Model]]:
        """Yield the bucket's decoded values by key: once loaded, then after every change."""
        nc = await self._connected()
        kv = await nc.jetstream().key_value(bucket)
        watcher = await kv.watchall()
        values: dict[str, Model] = {}
        loaded = False
        try:
            async for entry in watcher:
                if entry is None:
                    loaded = True
                elif entry.operation in ("DEL", "PURGE") or not entry.value:
                    values.pop(entry.key, None)
                else:
                    try:
                        values[entry.key] = decode_model(model, entry.value)
                    except DecodeError as exc:
                        log.warning("ignoring %s in %s: %s", entry.key, bucket, exc)
                        continue
                if loaded:
                    yield dict(values)
        finally:
            try:
                await watcher.stop()
            except Exception as exc:  # the connection may be gone already: nothing to stop
                log.debug("stopping the %s watch: %r", bucket, exc)

    async def _connected(self) -> Client:
        while (nc := self.client()) is None or not nc.is_connected:
            await asyncio.sleep(CONNECT_POLL_S)  # the backend connects in the background
        return nc


def _custom_cards(data_dir: Path) -> dict[str, ModelCard]:
    try:
        return custom_cards(data_dir)
    except (OSError, ValueError, FleetError) as exc:
        log.warning("custom model cards in %s not read: %s", data_dir, exc)
        return {}
