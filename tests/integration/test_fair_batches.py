"""Fair tenants for batch jobs (issue 25): a job's lines take their tenant's turn in the
model's batch class by the rule gateway requests follow (KV FLEET_FAIRNESS). Tenant A's big
job is under way when tenant B's small one starts; B weighs 4, A 1: B's lines enter the
queue about four for each of A's (with the turn taken out, the jobs alternate line for line:
`abababababababababab`; before jobs took turns at all, A's whole window went first).
Real nats-server, one `fleet worker` (fault engine, a runner of 2 slots: batch work takes
one), the gateway in process with its batch runner."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from nats.aio.msg import Msg

from fleet.commands.gateway import build_app
from fleet.config import load_settings
from fleet.gateway.keys import add_key
from fleet.wire.fairness import TenantShare
from tests.integration.harness import WorkerProcess, add_fault_card, fault_worker_stack, serving

pytestmark = pytest.mark.timeout(300)

MODEL = "fault-llm"
BIG, SMALL = 80, 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WorkerProcess, Path]]:
    root = tmp_path_factory.mktemp("fair-batches")
    with fault_worker_stack(root, MODEL) as (url, worker):
        yield url, worker, root


def lines(tenant: str, count: int) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{tenant}{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 20,
                 "messages": [{"role": "user", "content": "tokens:20 tokens_per_s:400"}]},
    }).encode() + b"\n" for i in range(count))


async def test_a_small_job_is_not_queued_behind_a_big_one_of_another_tenant(
    stack: tuple[str, WorkerProcess, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, worker, root = stack
    monkeypatch.setattr("fleet.gateway.fair_share.QUANTUM", 20.0)  # one line of A
    nc, _ = await serving(url, worker, add_fault_card(worker.data_dir, MODEL), slots=2)
    keys = root / "keys.jsonl"
    key = {tenant: add_key(keys, tenant) for tenant in ("a", "b")}
    weighed = [json.loads(line) for line in keys.read_text().splitlines()]
    keys.write_text("".join(json.dumps({**entry, "weight": 4 if entry["tenant"] == "b" else 1})
                            + "\n" for entry in weighed))
    settings = replace(load_settings({"nats_url": url, "data_dir": root / "gateway"}, env={}),
                       api_keys_file=str(keys))
    (root / "gateway").mkdir(exist_ok=True)
    add_fault_card(root / "gateway", MODEL)
    app = build_app(settings)
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                  base_url="http://gateway", timeout=60) as http):

        async def create(tenant: str, count: int) -> str:
            auth = {"authorization": f"Bearer {key[tenant]}"}
            upload = await http.post("/v1/files", data={"purpose": "batch"}, headers=auth,
                                     files={"file": ("in.jsonl", lines(tenant, count))})
            assert upload.status_code == 200, upload.text
            made = await http.post("/v1/batches", headers=auth, json={
                "input_file_id": upload.json()["id"], "completion_window": "24h",
                "endpoint": "/v1/chat/completions"})
            assert made.status_code == 200, made.text
            return str(made.json()["id"])

        async def job(tenant: str, batch_id: str) -> dict:  # type: ignore[type-arg]
            auth = {"authorization": f"Bearer {key[tenant]}"}
            return (await http.get(f"/v1/batches/{batch_id}", headers=auth)).json()

        published: list[str] = []  # the jobs' lines in the order they entered the queue
        under_way = asyncio.Event()

        async def seen(msg: Msg) -> None:
            published.append(json.loads(msg.data)["batch_id"])
            if len(published) == 20:
                under_way.set()

        await nc.subscribe(f"fleet.tasks.{MODEL}.batch", cb=seen)
        big = await create("a", BIG)
        await asyncio.wait_for(under_way.wait(), 120)  # A's window waits on the slack
        small = await create("b", SMALL)
        async with asyncio.timeout(240):
            for tenant, batch_id in (("b", small), ("a", big)):
                while (await job(tenant, batch_id))["status"] != "completed":
                    await asyncio.sleep(0.1)  # polling the API, as its clients do
        order = ["b" if batch_id == small else "a" for batch_id in published]
        assert order.count("b") == SMALL and order.count("a") == BIG, order
        first_b = order.index("b")
        last_b = max(i for i, tenant in enumerate(order) if tenant == "b")
        # B's ten lines by its weight: about 2.5 of A's among them (one for one: 9 or 10).
        assert order[first_b:last_b].count("a") <= 5, "".join(order)
    kv = await nc.jetstream().key_value("FLEET_FAIRNESS")
    charged = {t: TenantShare.model_validate_json((await kv.get(f"{MODEL}.batch.{t}")).value
                                                  or b"") for t in ("a", "b")}
    await nc.close()
    assert all(share.counter > 0 and share.waiting == 0 for share in charged.values()), charged
