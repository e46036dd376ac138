"""One metrics pipeline, with real processes: `fleet gateway` and `fleet worker
--metrics-port` each serve /metrics; both parse with a Prometheus text parser and carry the
same task histograms, the gateway's timed from the request, the worker's as the runner ran."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from fleet.models.catalog import get_card
from tests.bus.cluster import free_port
from tests.gateway_process import GatewayProcess
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import client, place_and_wait, wait_node
from tests.prometheus_text import SHARED_HISTOGRAMS, Scrape


async def scrape_until(http: httpx.AsyncClient, url: str, names: set[str],
                       timeout: float) -> Scrape:
    """The first scrape that has a sample of each of `names` (the worker records a task as it
    publishes its last event, which can be just after the gateway has answered; and one
    histogram after another, while the scrape is served from another thread: beside a CPU hog
    a scrape once came between its first and its second)."""
    async with asyncio.timeout(timeout):
        while True:
            scrape = Scrape.of((await http.get(url)).text)
            if names <= {sample.name for sample in scrape.samples
                         if sample.labels.get("gen_ai_request_model") == "tiny-llm"}:
                return scrape
            await asyncio.sleep(0.1)  # polling a scrape: nothing to wait on in between


async def test_gateway_and_worker_metrics_parse_and_carry_the_same_histograms(
    start_worker: WorkerFactory, tmp_path: Path, nats_url: str
) -> None:
    nc = await client(nats_url)
    port = free_port()
    worker = start_worker(FLEET_METRICS_PORT=str(port))
    node = await wait_node(nc, worker.data_dir)
    await place_and_wait(nc, get_card("tiny-llm"), node)
    await nc.close()
    data_dir = tmp_path / "gateway"
    data_dir.mkdir()
    gateway = GatewayProcess(nats_url, data_dir)
    chat = {
        "model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6, "temperature": 0, "stream": True,
    }
    try:
        await gateway.listening()
        async with httpx.AsyncClient(timeout=60) as http:
            reply = await http.post(f"{gateway.url}/v1/chat/completions", json=chat)
            assert reply.status_code == 200 and "[DONE]" in reply.text
            scraped = await http.get(f"{gateway.url}/metrics")
            at_worker = await scrape_until(http, f"http://127.0.0.1:{port}/metrics",
                                           {f"{name}_count" for name in SHARED_HISTOGRAMS}, 30)
    finally:
        gateway.stop()
    at_gateway = Scrape.of(scraped.text)
    assert at_gateway.histograms() >= SHARED_HISTOGRAMS
    assert at_worker.histograms() >= SHARED_HISTOGRAMS
    for scrape, scope in ((at_gateway, "fleet.gateway"), (at_worker, "fleet.worker")):
        tiny = {
            "gen_ai_request_model": "tiny-llm", "gen_ai_operation_name": "chat",
            "otel_scope_name": scope,
        }
        for name in SHARED_HISTOGRAMS - {"gen_ai_client_token_usage"}:
            assert scrape.value(f"{name}_count", **tiny) == 1, (scope, name)
        assert scrape.value("gen_ai_client_token_usage_sum", **tiny, gen_ai_token_type="output")
    service = {"service_name": "fleet-gateway"}
    assert at_gateway.value("target_info", **service) == 1
    assert at_worker.value("target_info", service_name="fleet-worker") == 1
