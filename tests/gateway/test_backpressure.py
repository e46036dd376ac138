"""A full model queue is a 429: FLEET_TASKS provisioned with a per-subject limit of 2."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client

from fleet.bus.embedded import ops_dir
from fleet.bus.provision import provision
from tests.prometheus_text import Scrape

QUEUE_LIMIT = 2
CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "timeout": 0.2}


@pytest.fixture
async def nc(nats_url: str, tmp_path: Path) -> AsyncIterator[Client]:
    """Provisioned before the gateway starts, so the tight limit is the one the server has."""
    definitions = tmp_path / "jetstream"
    shutil.copytree(ops_dir() / "jetstream", definitions)
    tasks = definitions / "FLEET_TASKS.json"
    config = json.loads(tasks.read_text())
    tasks.write_text(json.dumps({**config, "max_msgs_per_subject": QUEUE_LIMIT}))
    client = await nats.connect(nats_url)
    await provision(client, definitions)
    yield client
    await client.close()


async def test_a_full_queue_is_429_and_other_models_still_queue(
    client: httpx.AsyncClient,
) -> None:
    # Nobody consumes tiny-llm: each request times out (504) but its task stays queued.
    for _ in range(QUEUE_LIMIT):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 504
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "queue_full"
    assert response.headers["retry-after"] == "1"  # clients back off and come back
    assert response.json()["error"]["type"] == "rate_limit_error"

    other = await client.post("/v1/chat/completions", json={**CHAT, "model": "smollm2-135m"})
    assert other.status_code == 504  # queued, then timed out: a different subject's limit

    scrape = Scrape.of((await client.get("/metrics")).text)
    assert scrape.value("fleet_queue_depth", gen_ai_request_model="tiny-llm") == 2
    assert scrape.value("fleet_gateway_errors_total", error_type="queue_full") == 1
