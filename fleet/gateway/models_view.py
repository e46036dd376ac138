"""Which models are placed and ready, from the cards and the KV state; pure and table-tested.

A model is placed when an instance of it exists in FLEET_INSTANCES, and ready when one of its
instances has as many runners in FLEET_RUNNERS in a state that accepts tasks as it has shards
(a runner record names its instance; the worker picks runner ids after placement). A ready
runner whose instance is not (or no longer) listed still counts on its own: the runner says it
takes tasks, and the gateway tells what it sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.placement import HEARTBEAT_STALE_S, PlacementError, choose_node, unprovided
from fleet.wire.cluster import Instance, ModelCard, NodeInfo, RunnerRecord
from fleet.wire.runners import ACCEPTS_TASKS

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
        return exc.message
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
    unavailable: Unavailable | None = None,
) -> dict[str, Any]:
    data = [
        model_object(
            card, None if states is None else states.get(model, ModelState()),
            unavailable=unavailable,
        )
        for model, card in cards.items()
    ]
    return {"object": "list", "data": data}


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
