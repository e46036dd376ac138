"""The fleet's models: the cards and KV state the gateway mirrors, and which models are
placed, ready and available. Kept current by KV watches.

Cards come from KV FLEET_MODELS (so a model added with `fleet models add` on another machine
is known here at once), over the built-in cards and the custom cards of this data dir (read at
start, and again when a request names a model no card knows, at most once a second). The
nodes' capability records (FLEET_CAPABILITIES: which models each live node can provide, its
memory and disk room) say which models some node can serve, FLEET_INSTANCES which are placed
(and so served, or about to be). Requests read all three from memory: no disk or KV read per
request.

The gateway hears no heartbeat (issue 22: at N nodes that was N/3 messages a second for every
gateway): the sweeper writes a node's record when what the gateway reads of it changes and
deletes it when the node is gone (fleet/worker/capabilities.py), and marks the bucket as kept
every few seconds. Each record counts as fresh as that mark (fleet.capability_rules
.live_records), so with no worker left to keep them they go silent after HEARTBEAT_STALE_S, as
the last heartbeats did.

A request may name a model by an alias (a card's `aliases`, or this data dir's
`models/aliases.json`: fleet.models.catalog): `card` resolves it for every API, and `cards`
lists each model with the aliases that name it (so /v1/models shows them).

Each bucket is a `Mirror` (fleet/bus/kv_mirror.py: a fresh watch after every reconnect, since
nats-py's own stopped delivering after a server restart), a child of the gateway's Supervisor: a
watch that fails is logged and restarted with backoff.

Which models are placed and ready is a pure function of the cards and the KV state (table-
tested). A model is placed when an instance of it exists in FLEET_INSTANCES, and ready when one
of its instances has as many runners in FLEET_RUNNERS in a state that accepts tasks as it has
shards (a runner record names its instance; the worker picks runner ids after placement). A
ready runner whose instance is not (or no longer) listed still counts on its own: the runner
says it takes tasks, and the gateway tells what it sees."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from fleet.aio import Supervisor
from fleet.bus.kv_mirror import Connection, Mirror
from fleet.bus.weights import MODELS_BUCKET
from fleet.capability_rules import live_records
from fleet.errors import FleetError, PlacementError
from fleet.models.catalog import (
    alias_table,
    aliases_of,
    builtin_cards,
    configured_aliases,
    custom_cards,
    resolve_alias,
)
from fleet.placement import HEARTBEAT_STALE_S, able_to_shard, choose_node, unprovided
from fleet.placement_shards import ShardingError, fewest_shards
from fleet.wire import subjects
from fleet.wire.cluster import (
    CapabilitiesKeeper,
    Instance,
    ModelCard,
    NodeCapabilities,
    NodeInfo,
    RunnerRecord,
)
from fleet.wire.codec import DecodeError, decode_model
from fleet.wire.runners import ACCEPTS_TASKS

log = logging.getLogger(__name__)


Model = TypeVar("Model", bound=BaseModel)


# A request for a model no card names re-reads this data dir's cards at most this often, so a
# stream of requests for made-up names costs no disk read each.
LOCAL_REREAD_S = 1.0


class Catalogue:
    def __init__(
        self, data_dir: Path, connection: Connection,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.data_dir = data_dir
        self.connection = connection  # the backend's; it connects in the background
        self.local = {**builtin_cards(), **_custom_cards(data_dir)}
        self.configured_aliases = _configured_aliases(data_dir)
        self._clock = clock
        self._local_reread_at = -LOCAL_REREAD_S  # the first miss always reads
        self.fleet: dict[str, ModelCard] = {}
        self.records: dict[str, NodeCapabilities] = {}  # by FLEET_CAPABILITIES key
        self.keeper: CapabilitiesKeeper | None = None  # the sweeper's last mark
        self.nodes: list[NodeInfo] = []  # the records as placement's rules read nodes
        self.placed: set[str] = set()  # models with an instance in FLEET_INSTANCES
        self.instances: dict[str, Instance] = {}  # FLEET_INSTANCES, decoded by key
        self.nodes_loaded = False  # the capabilities watch has delivered every current record
        self.instances_loaded = False
        self.cards_loaded = False
        self._changed = asyncio.Event()  # set at a change, then replaced by a fresh one
        self._cards = Mirror(MODELS_BUCKET, self._cards_changed)
        self._nodes = Mirror(subjects.CAPABILITIES_BUCKET, self._nodes_changed)
        self._instances = Mirror(subjects.INSTANCES_BUCKET, self._instances_changed)

    # ---- reading (from memory) -----------------------------------------------------------

    def cards(self) -> dict[str, ModelCard]:
        """Every card by id, each with all the aliases that name it (configured ones too)."""
        merged = {**self.local, **self.fleet}
        table = alias_table(merged, self.configured_aliases)
        with_aliases = {}
        for model, card in sorted(merged.items()):
            aliases = aliases_of(model, table)
            with_aliases[model] = card if aliases == card.aliases else card.model_copy(
                update={"aliases": aliases})
        return with_aliases

    def card(self, model: str) -> ModelCard | None:
        """The card `model` names, by its id or an alias."""
        found = self._named(model)
        if found is None and (now := self._clock()) - self._local_reread_at >= LOCAL_REREAD_S:
            # A card or alias added to this data dir since (`fleet models add` without NATS):
            # read only for a name nothing resolves, never for the models being served.
            self._local_reread_at = now
            self.local = {**builtin_cards(), **_custom_cards(self.data_dir)}
            self.configured_aliases = _configured_aliases(self.data_dir)
            found = self._named(model)
        return found

    def _named(self, model: str) -> ModelCard | None:
        found = self.fleet.get(model) or self.local.get(model)
        if found is not None:
            return found
        target = resolve_alias(model, alias_table({**self.local, **self.fleet},
                                                  self.configured_aliases))
        return None if target is None else self.fleet.get(target) or self.local.get(target)

    def unavailable(self, card: ModelCard, placed: bool = False) -> str | None:
        """Why no node can serve `card` now; None when one can, or while the nodes are not
        known yet (the gateway just started, or NATS is down: the request path says so)."""
        if not (self.nodes_loaded and self.instances_loaded):
            # Until both are known a placed model may look unplaceable (its node's free memory
            # no longer counts it): a hog run saw 256 chats answered 503 in that window.
            return None
        placed = placed or card.id in self.placed
        return unavailable_reason(card, self.nodes, placed, time.time())

    def refuses(self, card: ModelCard) -> str | None:
        """Why a request for `card` fails at once. With no worker up at all the task waits
        in its queue instead: a worker may be starting, and it is served when it joins."""
        if not any(time.time() - n.at < HEARTBEAT_STALE_S for n in self.nodes):
            return None
        return self.unavailable(card)

    # ---- the watches ---------------------------------------------------------------------

    async def start(self, owner: Supervisor, wait_s: float) -> None:
        """Start the watches as children of `owner` (the gateway's lifespan, which stops
        them); wait up to `wait_s` for their first load, so that a healthy start knows the
        fleet's models before its first request."""
        for mirror in (self._cards, self._nodes, self._instances):
            owner.forever(f"watch {mirror.bucket}",
                          lambda m=mirror: m.run(self.connection))  # type: ignore[misc]
        with contextlib.suppress(TimeoutError):
            await self.until(
                lambda: self.cards_loaded and self.nodes_loaded and self.instances_loaded, wait_s
            )

    async def until(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait until `done()` holds after some change (TimeoutError after `timeout`)."""
        async with asyncio.timeout(timeout):
            while not done():
                await self._changed.wait()

    def _cards_changed(self, key: str | None) -> None:
        self.fleet = {card.id: card for card in _decoded(self._cards, ModelCard).values()}
        self.cards_loaded = True
        self._wake()

    def _nodes_changed(self, key: str | None) -> None:
        # One change decodes one record, not the table (a fleet's start writes N of them).
        if key == subjects.CAPABILITIES_KEEPER or key is None:
            raw = self._nodes.values.get(subjects.CAPABILITIES_KEEPER)
            self.keeper = _one(CapabilitiesKeeper, raw, self._nodes.bucket)
        if key != subjects.CAPABILITIES_KEEPER:
            self.records = _decoded(self._nodes, NodeCapabilities, self.records, key,
                                    subjects.node_of_capabilities_key)
        self.nodes = live_records(self.records, self.keeper)
        self.nodes_loaded = True
        self._wake()

    def _instances_changed(self, key: str | None) -> None:
        # One change decodes one instance: decoding the table at every change cost a gateway
        # 58 % of a core at N = 1,000 (1,000 instances, ~23 changes a second while placing).
        self.instances = _decoded(self._instances, Instance, self.instances, key)
        self.placed = {i.model for i in self.instances.values()}
        self.instances_loaded = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # the next waiters wait for the next change


def _decoded(
    mirror: Mirror, model: type[Model], before: dict[str, Model] | None = None,
    key: str | None = None, named: Callable[[str], str | None] = lambda key: key,
) -> dict[str, Model]:
    """The mirror's values decoded: all of them (`key` None: the mirror was replaced), else
    `before` with only `key` decoded afresh (or dropped: removed, or not decodable). Only
    the keys `named` names (by what it returns: the key, or None for a key left out)."""
    if key is None or before is None:
        keys, values = list(mirror.values), {}
    else:
        keys, values = [key], before
        values.pop(key, None)
    for name in keys:
        if named(name) is None or (raw := mirror.values.get(name)) is None:
            continue
        try:
            values[name] = decode_model(model, raw)
        except DecodeError as exc:
            log.warning("ignoring %s in %s: %s", name, mirror.bucket, exc)
    return values


def _one(model: type[Model], raw: bytes | None, bucket: str) -> Model | None:
    if raw is None:
        return None
    try:
        return decode_model(model, raw)
    except DecodeError as exc:
        log.warning("ignoring a %s in %s: %s", model.__name__, bucket, exc)
        return None


def _configured_aliases(data_dir: Path) -> dict[str, str]:
    try:
        return configured_aliases(data_dir)
    except (OSError, FleetError) as exc:
        log.warning("model aliases in %s not read: %s", data_dir, exc)
        return {}


def _custom_cards(data_dir: Path) -> dict[str, ModelCard]:
    try:
        return custom_cards(data_dir)
    except (OSError, ValueError, FleetError) as exc:
        log.warning("custom model cards in %s not read: %s", data_dir, exc)
        return {}


OWNER = "fleet"


@dataclass(frozen=True)
class ModelState:
    placed: bool = False
    ready: bool = False
    instances: int = 0
    ready_runners: int = 0


def model_states(
    cards: Iterable[str], instances: Iterable[Instance], runners: Iterable[RunnerRecord]
) -> dict[str, ModelState]:
    instances = list(instances)
    accepting = [r for r in runners if r.status.state in ACCEPTS_TASKS]
    known_instances = {i.instance_id for i in instances}
    states = {}
    for model in cards:
        placed = [i for i in instances if i.model == model]
        ready_runners = [r for r in accepting if r.model == model]
        complete = any(
            sum(r.instance_id == i.instance_id for r in ready_runners) >= len(i.shards)
            for i in placed
        )
        orphans_ready = any(r.instance_id not in known_instances for r in ready_runners)
        states[model] = ModelState(
            placed=bool(placed) or orphans_ready,
            ready=complete or orphans_ready,
            instances=len(placed),
            ready_runners=len(ready_runners),
        )
    return states


def unavailable_reason(
    card: ModelCard, nodes: Iterable[NodeInfo], placed: bool, now: float
) -> str | None:
    """Why no node can serve the model: none is up, none can provide its files, or none that
    can has the memory or disk room (placement's own reasons). None when one can, or when it
    is placed already (its node's free memory then no longer counts the model). Pure."""
    if placed:
        return None
    live = [n for n in nodes if now - n.at < HEARTBEAT_STALE_S]
    if not live:
        return f"no worker is up to serve {card.id} (start `fleet worker`)"
    able = [n for n in live if card.id in n.models_available]
    if not able:
        return unprovided(card, live)
    try:
        choose_node(able, card, now)
    except PlacementError as exc:
        try:  # placement on demand splits a model no single node holds
            fewest_shards(able_to_shard(able, card, now), card)
        except ShardingError as split:
            return f"{exc.message}; split over nodes: {split}"
    return None


Unavailable = Callable[[ModelCard, bool], str | None]


def model_object(
    card: ModelCard, state: ModelState | None, created: int = 0,
    unavailable: Unavailable | None = None,
) -> dict[str, Any]:
    """An OpenAI model object, with what Fleet knows about the model beside it; placement and
    readiness are null when NATS cannot tell. `available` says whether some node can serve it
    (null while the gateway does not know the nodes yet), `unavailable_reason` why not."""
    placed = bool(state and (state.placed or state.ready))
    why = unavailable(card, placed) if unavailable and state else None
    known = unavailable is not None and state is not None
    return {
        "id": card.id,
        "object": "model",
        "created": created,
        "owned_by": OWNER,
        "name": card.name,
        "aliases": list(card.aliases),
        "tasks": list(card.tasks),
        "capabilities": list(card.capabilities),
        "context_length": card.context_length,
        "placed": state.placed if state else None,
        "ready": state.ready if state else None,
        "instances": state.instances if state else None,
        "ready_runners": state.ready_runners if state else None,
        "available": (why is None) if known else None,
        "unavailable_reason": why,
    }


def model_list(
    cards: Mapping[str, ModelCard], states: Mapping[str, ModelState] | None,
    unavailable: Unavailable | None = None, *, everything: bool = False,
) -> dict[str, Any]:
    """The models a client can use now (`available` not false: placed, or some node can
    serve it), so an OpenAI client's model picker offers only those; `everything`: the
    whole catalogue, each with its `available` and `unavailable_reason`."""
    data = [
        model_object(
            card, None if states is None else states.get(model, ModelState()),
            unavailable=unavailable,
        )
        for model, card in cards.items()
    ]
    return {"object": "list", "data": [m for m in data if everything or servable(m)]}


def servable(model: Mapping[str, Any]) -> bool:
    """Listed by default: usable now, or not known to be unusable (NATS cannot tell)."""
    return model["available"] is not False


def refuses_images(card: ModelCard) -> str | None:
    """Why a model cannot read input images in a chat, or None when it can."""
    if "vision" in card.capabilities:
        return None
    return f"model {card.id} is text-only: it cannot read images (no 'vision' capability)"


def refuses_task(card: ModelCard, task: str) -> str | None:
    """Why a model cannot run this kind of request, or None when it can."""
    if task in card.tasks:
        return None
    does = ", ".join(card.tasks)
    return f"model {card.id} does not do {task.replace('_', ' ')} (it does: {does})"
