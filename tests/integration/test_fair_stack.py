"""Fair tenants through the gateway against nats-server and one `fleet worker` (fault engine, a
runner of 2 slots): tenant A keeps 10x tenant B's requests going, both weigh 1; once A's
head start is served, B gets about half the tokens served, not the 1/11 that first come,
first served would give it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from fleet.bus.fairness import shares
from fleet.commands.gateway import build_app
from fleet.config import load_settings
from fleet.gateway.keys import add_key
from tests.integration.harness import WorkerProcess, add_fault_card, fault_worker_stack, serving

pytestmark = pytest.mark.timeout(300)

MODEL = "fault-llm"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WorkerProcess, Path]]:
    root = tmp_path_factory.mktemp("fair")
    with fault_worker_stack(root, MODEL) as (url, worker):
        yield url, worker, root


async def test_a_flooding_tenant_leaves_the_other_its_share(
    stack: tuple[str, WorkerProcess, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, worker, root = stack
    monkeypatch.setattr("fleet.gateway.fair_share.QUANTUM", 60.0)  # about two requests
    nc, _ = await serving(url, worker, add_fault_card(worker.data_dir, MODEL), slots=2)
    keys = root / "keys.jsonl"
    key = {tenant: add_key(keys, tenant) for tenant in ("a", "b")}
    settings = replace(load_settings({"nats_url": url, "data_dir": root / "gateway"}, env={}),
                       api_keys_file=str(keys), gateway_timeout_s=120.0)
    (root / "gateway").mkdir(exist_ok=True)
    add_fault_card(root / "gateway", MODEL)  # the gateway's catalogue knows the model
    app = build_app(settings)
    served = {"a": 0, "b": 0}
    marks: dict[str, dict[str, int]] = {}
    done = asyncio.Event()
    stop = asyncio.Event()
    body = {"model": MODEL, "max_tokens": 20,
            "messages": [{"role": "user", "content": "tokens:20 tokens_per_s:200"}]}

    async def tenant_client(tenant: str) -> None:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120,
            headers={"authorization": f"Bearer {key[tenant]}"},
        ) as http:
            while not stop.is_set():
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                served[tenant] += response.json()["usage"]["completion_tokens"]
                if served["b"] >= 20 * 3:  # A's head start is served: measure from here
                    marks.setdefault("from", dict(served))
                if served["b"] >= 20 * 15:
                    marks.setdefault("to", dict(served))
                    done.set()

    async with app.router.lifespan_context(app):
        clients = [asyncio.ensure_future(tenant_client("a")) for _ in range(20)]
        clients += [asyncio.ensure_future(tenant_client("b")) for _ in range(2)]
        try:
            await asyncio.wait_for(done.wait(), 150)
        except TimeoutError:
            errors = [c.exception() for c in clients if c.done() and c.exception()]
            pytest.fail(f"B was not served its 15 requests: {served} {errors[:2]}")
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 120)
    await nc.close()
    window = {t: marks["to"][t] - marks["from"][t] for t in served}
    assert 0.3 < shares(window)["b"] < 0.7, (window, served)
