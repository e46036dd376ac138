"""The gateway under its own NATS role (the shipped ops/nats/auth.conf): it serves chat, resume
and tenant records with only the gateway's grants (one shared FLEET_OUT consumer, MSG.GET
replays, FLEET_TENANTS), and /healthz stops saying ok while NATS refuses it something."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import nats
import pytest
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client

import fleet.bus.denials as denials
from fleet.bus.provision import provision
from fleet.config import Settings
from fleet.gateway.app import build_app
from fleet.gateway.keys import add_key
from fleet.wire import subjects
from tests.secured import PASSWORDS, shipped_auth_server

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def secured_url(tmp_path: Path) -> Iterator[str]:
    with shipped_auth_server(tmp_path) as url:
        yield url


@pytest.fixture
async def operator(secured_url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(secured_url, user="operator", password=PASSWORDS["operator"])
    await provision(nc)
    yield nc
    await nc.close()


@pytest.fixture(autouse=True)
def forget_violations() -> Iterator[None]:
    yield
    # The record is per process, kept a minute: other tests' gateways must not inherit it.
    denials.forget_permission_errors()


async def test_the_gateway_serves_under_its_role_and_health_reports_refusals(
    settings: Settings, secured_url: str, operator: Client, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.jsonl"
    key = add_key(keys_file, "team-a")
    gateway_settings = replace(
        settings, nats_url=secured_url, nats_user="gateway",
        nats_password=PASSWORDS["gateway"], api_keys_file=str(keys_file),
    )
    worker = StandInWorker(operator, "tiny-llm")
    app = build_app(gateway_settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gateway", headers=headers
        ) as http:
            response, task = await asyncio.gather(
                http.post("/v1/chat/completions", json=CHAT),
                worker.answer(tokens_script("a", "b")),
            )
            assert response.status_code == 200, response.text
            replay = await http.get(f"/v1/tasks/{task.task_id}/events?format=native")
            assert replay.status_code == 200 and "task_finished" in replay.text
            health = await http.get("/healthz")
            assert health.status_code == 200, health.text
            assert "permission_errors" not in health.json()

            # the gateway's own connection does something its role forbids
            nc = app.state.gateway.backend.nc
            await nc.publish("fleet.events.node.forged", b"{}")
            await nc.flush()
            async with asyncio.timeout(5):
                while not denials.permission_errors():
                    await nc.flush()  # the -ERR arrives on this connection; wait on its pings
            refused = await http.get("/healthz")
            assert refused.status_code == 503
            assert refused.json()["permission_errors"] == ["publish fleet.events.node.forged"]
            anyone = await http.get("/healthz", headers={"authorization": ""})
            assert anyone.json() == {"status": "unavailable"}
    consumers = await operator.jetstream().consumers_info(subjects.OUT_STREAM)
    assert len(consumers) <= 1  # the gateway's shared one (gone once it closed)
