"""The dashboard's actions under NATS roles (the shipped ops/nats/auth.conf; the gateway
connects as its own user): an operator key places and removes an instance and reads the dead
letters, and the feed's watches see it; a tenant key is refused all three and sees only its
own tasks; an operator sees another tenant's trace and image, a tenant does not; no
permission violation on the gateway's connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client

import fleet.bus.denials as denials
from fleet.bus.objects import ObjectBucket
from fleet.bus.provision import provision
from fleet.commands.gateway import build_app
from fleet.config import load_settings
from fleet.gateway.keys import add_key
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import encode
from tests.dashboard.test_dashboard_feed import accepted, finished, next_fleet, own, rows_until
from tests.secured import PASSWORDS, shipped_auth_server


@pytest.fixture
def secured_url(tmp_path: Path) -> Iterator[str]:
    with shipped_auth_server(tmp_path) as url:
        yield url


@pytest.fixture
async def admin(secured_url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(secured_url, user="operator", password=PASSWORDS["operator"])
    await provision(nc)
    yield nc
    await nc.close()


async def test_operator_actions_under_the_gateways_role(
    secured_url: str, admin: Client, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.jsonl"
    ops, team = add_key(keys_file, "ops", operator=True), add_key(keys_file, "team-a")
    settings = replace(
        load_settings({"nats_url": secured_url, "data_dir": tmp_path / "data"}, env={}),
        nats_user="gateway", nats_password=PASSWORDS["gateway"], api_keys_file=str(keys_file),
    )
    js = admin.jetstream()
    now = time.time()
    node = NodeInfo(node_id="n-roles", hostname="h", memory_total_bytes=64 << 30,
                    memory_available_bytes=32 << 30, cpu_count=2, started_at=now, at=now,
                    models_available=["tiny-llm"])
    await (await js.key_value(subjects.NODES_BUCKET)).put(node.node_id, encode(node))
    await js.publish("fleet.dead.tiny-llm", b"{}", headers={"Fleet-Reason": "max deliveries"})
    app = build_app(settings)
    async with app.router.lifespan_context(app):
        feed = app.state.dashboard_feed
        tab = feed.subscribe("ops", sees_all=True)
        tenant_tab = feed.subscribe("team-a", sees_all=False)
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://g",
                              headers={"authorization": f"Bearer {ops}"}) as operator,
            httpx.AsyncClient(transport=transport, base_url="http://g",
                              headers={"authorization": f"Bearer {team}"}) as tenant,
        ):
            assert (await tenant.get("/ui/api/whoami")).json()["operator"] is False
            assert (await operator.get("/ui/api/whoami")).json()["operator"] is True
            body = {"model": "tiny-llm", "node": "n-roles"}
            assert (await tenant.post("/ui/api/instances", json=body)).status_code == 403
            assert (await tenant.get("/ui/api/dead")).status_code == 403

            placed = await operator.post("/ui/api/instances", json=body)
            assert placed.status_code == 200, placed.text
            instance_id = placed.json()["placed"]
            async with asyncio.timeout(10):
                while not [i for i in (await next_fleet(tab))["instances"]
                           if i["instance_id"] == instance_id]:
                    pass
            refused = await tenant.delete(f"/ui/api/instances/{instance_id}")
            assert refused.status_code == 403
            removed = await operator.delete(f"/ui/api/instances/{instance_id}")
            assert removed.status_code == 200, removed.text
            async with asyncio.timeout(10):
                while (await next_fleet(tab))["instances"]:
                    pass
            # Copies from the form: two replicas (one node here holds both); a split and
            # copies at once, or a count out of range, is refused before anything is placed.
            copies = await operator.post("/ui/api/instances", json={**body, "replicas": 2})
            assert copies.status_code == 200, copies.text
            assert len(copies.json()["instances"]) == 2 and copies.json()["nodes"] == ["n-roles"]
            for bad in ({"shards": 2, "replicas": 2}, {"replicas": 0}, {"shards": "two"}):
                refused = await operator.post("/ui/api/instances", json={**body, **bad})
                assert refused.status_code == 400, (bad, refused.text)
            for extra in copies.json()["instances"]:
                assert (await operator.delete(f"/ui/api/instances/{extra}")).status_code == 200
            again = await operator.delete(f"/ui/api/instances/{instance_id}")
            assert again.status_code == 404 and "no instance" in again.json()["error"]
            assert (await operator.delete("/ui/api/instances/never-placed")).status_code == 404

            dead = await operator.get("/ui/api/dead")
            assert dead.status_code == 200, dead.text
            assert [d["reason"] for d in dead.json()["dead_letters"]] == ["max deliveries"]

            for task_id, owner in (("t-a", "team-a"), ("t-b", "team-b")):
                await own(admin, task_id, owner)
                await admin.publish(subjects.out(task_id), encode(accepted(task_id)))
                await admin.publish(subjects.out(task_id), encode(finished(task_id)))
            assert (await rows_until(tab, {"t-a", "t-b"}))[0] == {"t-a", "t-b"}
            assert (await rows_until(tenant_tab, {"t-a"}))[0] == {"t-a"}
            other = await tenant.get("/ui/api/tasks/t-b/trace")
            assert other.status_code == 404  # another tenant's task reads as unknown
            assert (await operator.get("/ui/api/tasks/t-b/trace")).status_code == 200

            sha256 = await ObjectBucket(admin).put_by_hash(b"an image of team-b's")
            await js.publish(f"$KV.FLEET_TENANTS.image.{sha256}.team-b", b"1",
                             headers={"Nats-TTL": "3600s"})
            assert (await tenant.get(f"/ui/api/images/{sha256}")).status_code == 404
            shown = await operator.get(f"/ui/api/images/{sha256}")
            assert shown.status_code == 200 and shown.content == b"an image of team-b's"
            assert (await operator.get("/ui/api/images/not-a-hash")).status_code == 404
    assert not denials.permission_errors()
