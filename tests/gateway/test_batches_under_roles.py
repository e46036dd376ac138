"""A batch job through a gateway under its own NATS role (the shipped ops/nats/auth.conf):
files, the job's record, lease and results, its lines' tasks with their TTL and deadline
sentinels, and an Idempotency-Key, all with only the gateway's grants."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import nats
import pytest
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client

import fleet.bus.denials as denials
from fleet.bus.deadlines import STREAM, deadline_subject
from fleet.bus.provision import provision
from fleet.config import Settings
from fleet.gateway.app import build_app
from tests.secured import PASSWORDS, shipped_auth_server


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
    denials.forget_permission_errors()


def lines(count: int) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny-llm", "messages": [{"role": "user", "content": f"hi {i}"}]},
    }).encode() + b"\n" for i in range(count))


async def test_a_batch_job_runs_under_the_gateway_role(
    settings: Settings, secured_url: str, operator: Client
) -> None:
    gateway_settings = replace(settings, nats_url=secured_url, nats_user="gateway",
                               nats_password=PASSWORDS["gateway"])
    worker = StandInWorker(operator, "tiny-llm")
    app = build_app(gateway_settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            key = {"Idempotency-Key": "upload-1"}
            upload = await http.post("/v1/files", data={"purpose": "batch"}, headers=key,
                                     files={"file": ("in.jsonl", lines(2))})
            again = await http.post("/v1/files", data={"purpose": "batch"}, headers=key,
                                    files={"file": ("in.jsonl", lines(2))})
            assert upload.status_code == again.status_code == 200, upload.text
            assert again.json()["id"] == upload.json()["id"]
            created = await http.post("/v1/batches", json={
                "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"})
            assert created.status_code == 200, created.text
            batch_id = created.json()["id"]
            answered = [await worker.answer(tokens_script("o", "k"), priority="batch")
                        for _ in range(2)]
            assert {t.batch_id for t in answered} == {batch_id}
            assert all("Nats-TTL" in h for h in worker.headers)
            sentinel = await operator.jetstream().get_last_msg(
                STREAM, deadline_subject("tiny-llm", answered[0].task_id))
            assert "Nats-TTL" in (sentinel.headers or {})
            deadline = time.monotonic() + 30
            while (batch := (await http.get(f"/v1/batches/{batch_id}")).json())[
                    "status"] != "completed":
                assert time.monotonic() < deadline, batch
                await asyncio.sleep(0.1)  # polling the API, as its clients do
            output = await http.get(f"/v1/files/{batch['output_file_id']}/content")
            bodies = [json.loads(x)["response"]["body"] for x in output.text.splitlines()]
            assert [b["choices"][0]["message"]["content"] for b in bodies] == ["ok", "ok"]
    assert not denials.permission_errors()
