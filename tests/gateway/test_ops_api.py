"""/healthz, /v1/models and /metrics tell what the KV buckets and the gateway saw."""

from __future__ import annotations

import asyncio

import httpx
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client

from fleet.bus.provision import ensure_task_consumer
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord, ShardAssignment
from fleet.wire.codec import encode
from fleet.wire.runners import RunnerLoading, RunnerReady
from tests.prometheus_text import SHARED_HISTOGRAMS, Scrape


async def place(nc: Client, model: str, runner_id: str, ready: bool) -> None:
    js = nc.jetstream()
    shard = ShardAssignment(node_id="n1", runner_id="pending")  # the worker names runners
    instance = Instance(instance_id=f"i-{model}", model=model, shards=[shard], created_at=1)
    status = RunnerReady() if ready else RunnerLoading(layers_done=1, layers_total=30)
    record = RunnerRecord(
        runner_id=runner_id,
        instance_id=instance.instance_id,
        node_id="n1",
        model=model,
        status=status,
        at=1,
    )
    await (await js.key_value(subjects.INSTANCES_BUCKET)).put(
        instance.instance_id, encode(instance)
    )
    await (await js.key_value(subjects.RUNNERS_BUCKET)).put(runner_id, encode(record))


async def test_health_and_models_say_which_models_are_ready(
    client: httpx.AsyncClient, nc: Client
) -> None:
    await place(nc, "tiny-llm", "r-tiny", ready=True)
    await place(nc, "smollm2-135m", "r-smol", ready=False)

    health = await client.get("/healthz")
    assert health.status_code == 200
    report = health.json()
    assert report["status"] == "ok" and report["nats"]["connected"]
    assert all(report["streams"].values()) and "FLEET_OUT" in report["streams"]
    assert report["models"]["tiny-llm"] == {"placed": True, "ready": True, "queue_depth": 0}
    assert report["models"]["smollm2-135m"]["ready"] is False
    assert report["models"]["tiny-flux2"] == {"placed": False, "ready": False, "queue_depth": 0}

    models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert models["tiny-llm"]["ready"] and models["tiny-llm"]["object"] == "model"
    assert models["smollm2-135m"]["placed"] and not models["smollm2-135m"]["ready"]
    one = await client.get("/v1/models/tiny-flux2")
    assert one.json()["tasks"] == ["text_to_image", "image_to_image"]
    assert (await client.get("/v1/models/nope")).status_code == 404


async def test_metrics_count_requests_tokens_and_latency(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    chat = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    await asyncio.gather(
        client.post("/v1/chat/completions", json=chat), worker.answer(tokens_script("a", "b"))
    )
    await client.post("/v1/chat/completions", json={**chat, "model": "nope"})
    scraped = await client.get("/metrics")
    assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    scrape = Scrape.of(scraped.text)
    requests = "http_server_request_duration_seconds_count"
    chat_route = {"http_route": "/v1/chat/completions", "http_request_method": "POST"}
    assert scrape.value(requests, **chat_route, http_response_status_code="200") == 1
    assert scrape.value(requests, **chat_route, http_response_status_code="404") == 1
    assert scrape.value("fleet_gateway_errors_total", error_type="model_not_found") == 1
    tiny = {"gen_ai_request_model": "tiny-llm"}
    tokens = "gen_ai_client_token_usage_sum"
    assert scrape.value(tokens, **tiny, gen_ai_token_type="output") == 2
    assert scrape.histograms() >= SHARED_HISTOGRAMS
    assert scrape.value("gen_ai_server_time_to_first_token_seconds_count", **tiny) == 1
    assert scrape.value("gen_ai_server_time_per_output_token_seconds_count", **tiny) == 1
    assert scrape.value("gen_ai_server_request_duration_seconds_count", **tiny) == 1
    assert scrape.types["fleet_queue_depth"] == "gauge"

async def test_metrics_count_tasks_in_flight_redelivered_and_dead_lettered(
    client: httpx.AsyncClient, nc: Client
) -> None:
    js = nc.jetstream()
    await ensure_task_consumer(nc, "tiny-llm")

    async def queue(n: int) -> None:
        await js.publish(subjects.tasks("tiny-llm"), b"{}", headers={"Nats-Msg-Id": f"t{n}"})

    await queue(0)
    await queue(1)
    pull = await js.pull_subscribe_bind(subjects.durable("tiny-llm"), subjects.TASKS_STREAM)
    first, second = await pull.fetch(2, timeout=5)  # a worker took both
    await second.ack()
    await first.nak()  # given back: handed out again, now for the second time
    [again] = await pull.fetch(1, timeout=5)
    assert again.metadata.num_delivered == 2
    await queue(2)  # waits: nobody fetches it
    await js.publish(subjects.dead_letter("tiny-llm"), b"{}")

    scrape = Scrape.of((await client.get("/metrics")).text)
    tiny = {"gen_ai_request_model": "tiny-llm"}
    assert scrape.value("fleet_queue_depth", **tiny) == 2
    assert scrape.value("fleet_tasks_in_flight", **tiny) == 1
    assert scrape.value("fleet_tasks_redelivered", **tiny) == 1
    assert scrape.value("fleet_tasks_dead_lettered", **tiny) == 1
