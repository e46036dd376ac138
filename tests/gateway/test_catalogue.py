"""The gateway's model catalogue: cards from KV FLEET_MODELS (a gateway started after a model
was added elsewhere lists and serves it), and availability from the nodes' capability
records (FLEET_CAPABILITIES, kept by the sweeper from the heartbeats: a request for a model
no live node can serve fails at once, saying why). Real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client
from starlette.applications import Starlette

from fleet.bus.embedded import EmbeddedNats
from fleet.bus.weights import FleetModels
from fleet.capability_rules import capabilities_of
from fleet.config import Settings
from fleet.gateway.app import build_app
from fleet.gateway.catalogue import Catalogue, unavailable_reason
from fleet.models.catalog import describe_model_dir, get_card
from fleet.wire import subjects
from fleet.wire.cluster import CapabilitiesKeeper, Instance, NodeInfo, ShardAssignment
from fleet.wire.codec import encode

NOW = 1000.0
GB = 1 << 30


def node(
    node_id: str, available: tuple[str, ...] = (), at: float = NOW, **more: object
) -> NodeInfo:
    fields = {
        "node_id": node_id, "hostname": node_id, "memory_total_bytes": 64 * GB,
        "memory_available_bytes": 16 * GB, "cpu_count": 2, "models_available": list(available),
        "started_at": 0.0, "at": at, **more,
    }
    return NodeInfo.model_validate(fields)


@pytest.mark.parametrize(
    ("nodes", "placed", "why"),
    [
        ([], False, "no worker is up"),
        ([], True, None),  # placed: its runner serves it whatever the heartbeats say
        ([node("a", ("tiny-llm",), at=NOW - 60)], False, "no worker is up"),  # stale
        ([node("a", ("smollm2-135m",))], False, "no live node can provide tiny-llm (a)"),
        ([node("a", ("tiny-llm",))], False, None),
        ([node("a", ("tiny-llm",), memory_available_bytes=10)], False, "node a: 10 bytes of free"),
        ([node("a", ("tiny-llm",), models_disk_room_bytes=0)], False, "disk budget leaves"),
        ([node("a"), node("b", ("tiny-llm",))], False, None),
        # 431 kB of tiny-llm on two nodes of 300 kB: split, each holds its layer
        ([node(n, ("tiny-llm",), memory_available_bytes=300_000, ring_address=f"{n}:1")
          for n in "ab"], False, None),
        ([node(n, ("tiny-llm",), memory_available_bytes=300_000) for n in "ab"], False,
         "split over nodes: 2 shards of tiny-llm need 2 live nodes that can join a ring"),
    ],
)
def test_unavailable_reason(nodes: list[NodeInfo], placed: bool, why: str | None) -> None:
    found = unavailable_reason(get_card("tiny-llm"), nodes, placed, NOW)
    assert found == why if why is None else why in (found or "")


def test_a_placed_model_is_not_refused_before_the_instances_are_known(tmp_path: Path) -> None:
    # Its node's free memory no longer counts the model it holds, so without the instance
    # table the model looks unplaceable: the catalogue says nothing until it has both.
    catalogue = Catalogue(tmp_path, connection=None)  # type: ignore[arg-type]
    catalogue.nodes = [node("a", ("tiny-llm",), at=time.time(), memory_available_bytes=10)]
    catalogue.nodes_loaded = True
    card = get_card("tiny-llm")
    assert catalogue.unavailable(card) is None
    catalogue.instances_loaded = True
    assert "10 bytes of free" in (catalogue.unavailable(card) or "")
    catalogue.placed = {"tiny-llm"}
    assert catalogue.unavailable(card) is None


def test_unknown_models_read_the_data_dir_at_most_once_a_second(tmp_path: Path) -> None:
    now = [100.0]
    catalogue = Catalogue(tmp_path, connection=None, clock=lambda: now[0])  # type: ignore[arg-type]
    assert catalogue.card("tiny-later") is None  # read: no such card
    folder = tmp_path / "models" / "custom"
    folder.mkdir(parents=True)
    (folder / "tiny-later.json").write_text(
        '{"id": "tiny-later", "name": "test", "tasks": ["text_generation"], '
        '"family": "mlx_lm", "source": "/nowhere"}')
    now[0] += 0.5
    assert catalogue.card("tiny-later") is None  # a second miss within the second: not read
    now[0] += 0.5
    card = catalogue.card("tiny-later")  # the card added since is found
    assert card is not None and card.id == "tiny-later"


def _model_dir(root: Path) -> Path:
    folder = root / "elsewhere"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"w" * 4096)
    return folder


async def _heartbeat(nc: Client, info: NodeInfo) -> None:
    """What the sweeper writes of a node's heartbeat (fleet/worker/capabilities.py)."""
    kv = await nc.jetstream().key_value(subjects.CAPABILITIES_BUCKET)
    await kv.put(subjects.CAPABILITIES_KEEPER,
                 encode(CapabilitiesKeeper(node_id="sweeper", at=info.at)))
    await kv.put(subjects.capabilities_key(info.node_id), encode(capabilities_of(info)))


def _knows(catalogue: Catalogue, node_id: str) -> bool:
    return any(n.node_id == node_id for n in catalogue.nodes)


@pytest.fixture
async def started(settings: Settings, provisioned_nc: Client, tmp_path: Path
                  ) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    # Added "on another machine" before this gateway starts: only FLEET_MODELS knows it.
    folder = _model_dir(tmp_path)
    await FleetModels(provisioned_nc).publish(describe_model_dir("far-model", folder), folder)
    app = build_app(settings)
    async with app.router.lifespan_context(app):
        catalogue: Catalogue = app.state.gateway.catalogue
        await catalogue.until(lambda: catalogue.cards_loaded and catalogue.nodes_loaded, 10)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield app, http


async def test_a_model_added_elsewhere_is_listed_and_served(
    started: tuple[Starlette, httpx.AsyncClient], provisioned_nc: Client
) -> None:
    app, http = started
    catalogue: Catalogue = app.state.gateway.catalogue
    assert "far-model" not in {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
    models = {m["id"]: m for m in (await http.get("/v1/models?all=true")).json()["data"]}
    assert "far-model" in models
    assert models["far-model"]["available"] is False  # no worker is up yet
    assert "no worker is up" in models["far-model"]["unavailable_reason"]

    await _heartbeat(provisioned_nc, node("n1", ("far-model",), at=time.time()))
    await catalogue.until(lambda: _knows(catalogue, "n1"), 10)
    listed = (await http.get("/v1/models/far-model")).json()
    assert listed["available"] is True and listed["unavailable_reason"] is None
    chat = {"model": "far-model", "messages": [{"role": "user", "content": "hi"}]}
    reply, _ = await asyncio.gather(
        http.post("/v1/chat/completions", json=chat),
        StandInWorker(provisioned_nc, "far-model").answer(tokens_script("far", " away")),
    )
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "far away"


async def test_a_model_no_live_node_can_serve_fails_at_once_with_the_reason(
    started: tuple[Starlette, httpx.AsyncClient], provisioned_nc: Client
) -> None:
    app, http = started
    catalogue: Catalogue = app.state.gateway.catalogue
    await _heartbeat(provisioned_nc, node("n1", ("tiny-llm",), at=time.time()))
    await catalogue.until(lambda: _knows(catalogue, "n1"), 10)
    chat = {"model": "far-model", "messages": [{"role": "user", "content": "hi"}]}
    started_at = time.monotonic()
    reply = await http.post("/v1/chat/completions", json=chat)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "model_unavailable"
    assert "no live node can provide far-model (n1)" in error["message"]
    assert time.monotonic() - started_at < 5.0  # not the request timeout (10 s here)
    listed = {m["id"]: m for m in (await http.get("/v1/models?all=true")).json()["data"]}
    assert listed["far-model"]["available"] is False
    assert listed["tiny-llm"]["available"] is True
    # By default only what a client can use now: an OpenAI model picker offers no dead end.
    usable = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
    assert "tiny-llm" in usable and "far-model" not in usable
    assert usable == {m for m, about in listed.items() if about["available"]}
    assert (await http.get("/v1/models?all=maybe")).status_code == 400

    # Once placed (here by hand, on a node whose heartbeat lacks it) it is served: a node
    # running a model no longer has the free memory the model takes, and that must not count.
    shard = ShardAssignment(node_id="n1", runner_id="pending")
    instance = Instance(instance_id="i-far", model="far-model", shards=[shard], created_at=1)
    kv = await provisioned_nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    await kv.put(instance.instance_id, encode(instance))
    await catalogue.until(lambda: "far-model" in catalogue.placed, 10)
    reply, _ = await asyncio.gather(
        http.post("/v1/chat/completions", json=chat),
        StandInWorker(provisioned_nc, "far-model").answer(tokens_script("served")),
    )
    assert reply.status_code == 200


async def test_the_catalogue_keeps_watching_after_the_server_restarts(
    started: tuple[Starlette, httpx.AsyncClient], provisioned_nc: Client,
    nats_server: EmbeddedNats,
) -> None:
    app, _ = started
    catalogue: Catalogue = app.state.gateway.catalogue
    await _heartbeat(provisioned_nc, node("n-before", ("far-model",), at=time.time()))
    await catalogue.until(lambda: _knows(catalogue, "n-before"), 10)
    nats_server.stop()
    await asyncio.to_thread(nats_server.start)  # the same port and store
    async with asyncio.timeout(30):
        while not (provisioned_nc.is_connected and app.state.gateway.backend.connected):
            await asyncio.sleep(0.1)  # nats-py reconnects on its own timer
    await _heartbeat(provisioned_nc, node("n-after", ("far-model",), at=time.time()))
    await catalogue.until(lambda: _knows(catalogue, "n-after"), 30)
