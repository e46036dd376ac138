"""The gateway's metrics as a scrape shows them: what TaskObserver records, under the names
fleet/meters.py gives, parsed by prometheus_client's text parser."""

from __future__ import annotations

import pytest

from fleet.gateway.backend import ModelQueue
from fleet.gateway.observability import GatewayMetrics, TaskObserver
from fleet.wire.events import ErrorReason, TaskAccepted, TaskFinished, TokenChunk, Usage
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.prometheus_text import SHARED_HISTOGRAMS, Scrape

MODEL = {"gen_ai_request_model": "m", "gen_ai_operation_name": "chat"}
CHAT = TextGeneration(task_id="t", model="m", messages=[ChatMessage(role="user", content="hi")])


def accepted(task_id: str) -> TaskAccepted:
    return TaskAccepted(task_id=task_id, at=0, model="m", node_id="n", runner_id="r")


def test_observer_times_a_task_from_the_request() -> None:
    metrics = GatewayMetrics()
    observer = TaskObserver(metrics, CHAT, started=10.0)
    observer.see(accepted("t"), 10.25)
    observer.see(accepted("t"), 10.4)  # redelivered: the first acceptance counts
    for index, now in enumerate((10.5, 10.7, 10.9)):
        observer.see(TokenChunk(task_id="t", at=0, index=index, token_id=0, text="x"), now)
    usage = Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7)
    observer.see(TaskFinished(task_id="t", at=0, status="completed", usage=usage), 11.0)

    scrape = Scrape.of(metrics.render({}).decode())
    assert scrape.histograms() >= SHARED_HISTOGRAMS
    assert scrape.value("fleet_task_queue_wait_seconds_sum", **MODEL) == pytest.approx(0.25)
    assert scrape.value("fleet_task_queue_wait_seconds_count", **MODEL) == 1
    assert scrape.value("gen_ai_server_time_to_first_token_seconds_sum", **MODEL) == 0.5
    tpot = scrape.value("gen_ai_server_time_per_output_token_seconds_sum", **MODEL)
    assert tpot == pytest.approx(0.2)
    assert scrape.value("gen_ai_server_request_duration_seconds_sum", **MODEL) == 1.0
    tokens = "gen_ai_client_token_usage_sum"
    assert scrape.value(tokens, **MODEL, gen_ai_token_type="input") == 4
    assert scrape.value(tokens, **MODEL, gen_ai_token_type="output") == 3
    assert scrape.value(
        "gen_ai_server_time_to_first_token_seconds_bucket", **MODEL, le="0.5"
    ) == 1
    assert scrape.value(
        "gen_ai_server_time_to_first_token_seconds_bucket", **MODEL, le="0.25"
    ) == 0


def test_a_failed_task_has_its_error_type_and_no_token_timings() -> None:
    metrics = GatewayMetrics()
    failed = TaskFinished(
        task_id="t", at=0, status="failed", reason=ErrorReason.RUNNER_CRASHED, message="x"
    )
    TaskObserver(metrics, CHAT, started=1.0).see(failed, 3.0)
    metrics.error(ErrorReason.RUNNER_CRASHED.value)
    scrape = Scrape.of(metrics.render({}).decode())
    duration = "gen_ai_server_request_duration_seconds_count"
    assert scrape.value(duration, **MODEL, error_type="runner_crashed") == 1
    assert scrape.value("gen_ai_server_time_to_first_token_seconds_count", **MODEL) is None
    assert scrape.value("fleet_gateway_errors_total", error_type="runner_crashed") == 1
    assert scrape.types["fleet_gateway_errors"] == "counter"


def test_gauges_are_what_the_scrape_was_given() -> None:
    metrics = GatewayMetrics()
    queue = ModelQueue(queued=3, in_flight=2, redelivered=1, dead_lettered=4)
    scrape = Scrape.of(metrics.render({"m": queue}, waiting=5).decode())
    assert scrape.value("fleet_gateway_waiting_requests") == 5
    model = {"gen_ai_request_model": "m"}
    assert scrape.value("fleet_queue_depth", **model) == 3
    assert scrape.value("fleet_tasks_in_flight", **model) == 2
    assert scrape.value("fleet_tasks_redelivered", **model) == 1
    assert scrape.value("fleet_tasks_dead_lettered", **model) == 4
    assert {scrape.types[name] for name in ("fleet_queue_depth", "fleet_tasks_in_flight")} == {
        "gauge"
    }
    again = Scrape.of(metrics.render({}).decode())  # a model gone from JetStream is gone here
    assert again.value("fleet_queue_depth", **model) is None


def test_each_gateway_counts_from_zero() -> None:
    GatewayMetrics().error("queue_full")
    scrape = Scrape.of(GatewayMetrics().render({}).decode())
    assert scrape.value("fleet_gateway_errors_total", error_type="queue_full") is None
