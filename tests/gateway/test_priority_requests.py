"""A request's priority class at the gateway: the Fleet-Priority header, clamped by the
tenant record's max_priority, stamped with the tenant into the task, which is published on
its class's subject with its deadline in the broker (Nats-TTL). Real nats-server, the app
in-process, a stand-in worker per class."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import orjson
import pytest
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client
from starlette.applications import Starlette

from fleet.config import Settings
from fleet.errors import InvalidRequest
from fleet.gateway.app import build_app
from fleet.gateway.keys import KeyRing, add_key, parse_policies
from fleet.gateway.priority import TenantPolicy, asked_priority, policy_of_line

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("header", "asked"), [
    (None, "default"), ("", "default"), ("interactive", "interactive"),
    (" Batch ", "batch"), ("DEFAULT", "default"),
])
def test_the_header(header: str | None, asked: str) -> None:
    assert asked_priority(header) == asked


@pytest.mark.parametrize("header", ["urgent", "0", "interactive,batch"])
def test_a_header_naming_no_class_is_refused(header: str) -> None:
    with pytest.raises(InvalidRequest, match="Fleet-Priority"):
        asked_priority(header)


@pytest.mark.parametrize(("entry", "policy"), [
    ({}, TenantPolicy()),
    ({"max_priority": "batch"}, TenantPolicy("batch", 1.0)),
    ({"weight": 3}, TenantPolicy("interactive", 3.0)),
    ({"max_priority": "default", "weight": 0.5}, TenantPolicy("default", 0.5)),
])
def test_tenant_record_fields(entry: dict[str, object], policy: TenantPolicy) -> None:
    assert policy_of_line(entry, "keys:1") == policy


@pytest.mark.parametrize("entry", [
    {"max_priority": "urgent"}, {"weight": 0}, {"weight": -1}, {"weight": "2"},
    {"weight": True},
])
def test_bad_tenant_record_fields_name_their_line(entry: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="keys:7"):
        policy_of_line(entry, "keys:7")


def test_the_first_line_of_a_tenant_that_names_a_policy_decides() -> None:
    lines = [{"tenant": "a", "sha256": "0" * 64},
             {"tenant": "a", "sha256": "1" * 64, "max_priority": "batch", "weight": 2},
             {"tenant": "a", "sha256": "2" * 64, "weight": 9}]
    text = "\n".join(orjson.dumps(line).decode() for line in lines)
    assert parse_policies(text) == {"a": TenantPolicy("batch", 2.0)}
    assert KeyRing({}).policy("a") == TenantPolicy()


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "keys.jsonl"
    free = add_key(path, "free")
    with path.open("a") as file:  # a tenant record that caps its class and sets its share
        file.write('{"tenant": "bulk", "sha256": "' + "f" * 64 + '", "max_priority": '
                   '"default", "weight": 0.5}\n')
    return {"file": str(path), "free": free, "bulk": add_key(path, "bulk")}


@pytest.fixture
async def tenant_app(
    settings: Settings, nc: Client, keys: dict[str, str]
) -> AsyncIterator[Starlette]:
    app = build_app(replace(settings, api_keys_file=keys["file"]))
    async with app.router.lifespan_context(app):
        yield app


def as_key(app: Starlette, key: str, priority: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway",
        headers={"authorization": f"Bearer {key}", "fleet-priority": priority},
    )


@pytest.mark.parametrize(("tenant", "asked", "gets"), [
    ("free", "interactive", "interactive"),
    ("bulk", "interactive", "default"),  # clamped to the tenant's max_priority
    ("bulk", "batch", "batch"),
])
async def test_the_task_carries_its_clamped_class_and_tenant_on_its_subject(
    tenant_app: Starlette, keys: dict[str, str], nc: Client, tenant: str, asked: str,
    gets: str,
) -> None:
    worker = StandInWorker(nc, "tiny-llm")
    async with as_key(tenant_app, keys[tenant], asked) as client:
        response, task = await asyncio.gather(
            client.post("/v1/chat/completions", json=CHAT),
            worker.answer(tokens_script("x"), priority=gets),
        )
    assert response.status_code == 200, response.text
    assert (task.priority, task.tenant) == (gets, tenant)
    assert worker.headers[0]["Nats-TTL"].endswith("s")  # dropped at its deadline + a grace


async def test_a_bad_header_is_a_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT,
                                 headers={"fleet-priority": "urgent"})
    assert response.status_code == 400
    assert "Fleet-Priority" in response.json()["error"]["message"]

