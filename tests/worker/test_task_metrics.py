"""A worker's /metrics: the runner's timings of each finished task under the same histogram
names as the gateway's, served by prometheus_client's server on `--metrics-port`."""

from __future__ import annotations

import socket

import httpx
import pytest
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter

from fleet.errors import InvalidSetting
from fleet.meters import exemplar_filter
from fleet.wire.events import TaskFinished, TaskStats, Usage
from fleet.worker.task_metrics import TaskMetrics
from tests.bus.cluster import free_port
from tests.prometheus_text import SHARED_HISTOGRAMS, Scrape

TINY = {"gen_ai_request_model": "tiny-llm", "otel_scope_name": "fleet.worker"}
IMAGES = {"gen_ai.request.model": "tiny-llm", "gen_ai.operation.name": "image_generation"}


def finished(status: str = "completed") -> TaskFinished:
    stats = TaskStats(queue_wait_s=0.5, time_to_first_token_s=0.25, tokens_per_s=20, total_s=2)
    usage = Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12)
    return TaskFinished(task_id="t", at=0, status=status, usage=usage, stats=stats)


def test_a_finished_task_is_served_on_the_metrics_port() -> None:
    metrics = TaskMetrics(held=lambda: 2)
    metrics.finished(IMAGES, finished())
    port = free_port()
    with metrics.served("127.0.0.1", port) as served:
        assert served == port
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert scraped.status_code == 200
    scrape = Scrape.of(scraped.text)
    assert scrape.histograms() >= SHARED_HISTOGRAMS
    assert scrape.value("fleet_worker_tasks") == 2
    assert scrape.value(
        "gen_ai_server_time_to_first_token_seconds_sum", **TINY,
        gen_ai_operation_name="image_generation",
    ) == 0.25
    assert scrape.value("gen_ai_server_time_per_output_token_seconds_sum", **TINY) == 0.05
    assert scrape.value("fleet_task_queue_wait_seconds_sum", **TINY) == 0.5
    assert scrape.value("gen_ai_server_request_duration_seconds_sum", **TINY) == 2
    assert scrape.value("gen_ai_client_token_usage_sum", **TINY, gen_ai_token_type="output") == 7
    with pytest.raises(httpx.TransportError):  # closed with the block
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_no_port_serves_nothing_and_a_busy_port_is_a_clear_error() -> None:
    metrics = TaskMetrics()
    with metrics.served("127.0.0.1", 0) as served:
        assert served is None
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        refused = pytest.raises(InvalidSetting, match=f"--metrics-port {port}")
        with refused, metrics.served("127.0.0.1", port):
            pass


def test_a_cancelled_task_has_its_error_type() -> None:
    metrics = TaskMetrics()
    metrics.finished(IMAGES, finished("cancelled"))
    scrape = Scrape.of(metrics.meters.exposition().decode())
    duration = "gen_ai_server_request_duration_seconds_count"
    assert scrape.value(duration, **TINY, error_type="cancelled") == 1


def _prompt(prompt: int, cached: int) -> TaskFinished:
    usage = Usage(
        prompt_tokens=prompt, completion_tokens=4, total_tokens=prompt + 4, cached_tokens=cached
    )
    return TaskFinished(task_id="t", status="completed", at=0.0, usage=usage)


def test_prefix_cache_hit_ratio_per_model() -> None:
    metrics = TaskMetrics()
    tiny = {"gen_ai.request.model": "tiny-llm", "gen_ai.operation.name": "chat"}
    smol = {"gen_ai.request.model": "smollm2-135m", "gen_ai.operation.name": "chat"}
    metrics.finished(tiny, _prompt(prompt=100, cached=0))
    metrics.finished(tiny, _prompt(prompt=300, cached=280))
    metrics.finished(smol, _prompt(prompt=50, cached=25))
    scrape = Scrape.of(metrics.meters.exposition().decode())
    ratio = "fleet_prefix_cache_hit_ratio"
    assert scrape.value(ratio, gen_ai_request_model="tiny-llm") == 0.7
    assert scrape.value(ratio, gen_ai_request_model="smollm2-135m") == 0.5
    cached = "fleet_prefix_cache_cached_tokens_total"
    assert scrape.value(cached, gen_ai_request_model="tiny-llm") == 280
    assert metrics.hit_ratio("tiny-llm") == 0.7
    assert metrics.hit_ratio("nobody") is None


@pytest.mark.parametrize(("env", "sampled"), [
    ({}, False),  # only Prometheus reads the metrics: it drops exemplars
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_METRICS_EXEMPLAR_FILTER": "always_on"}, True),  # asked for: the SDK decides
])
def test_exemplars_are_sampled_only_where_they_are_exported(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], sampled: bool
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_METRICS_EXEMPLAR_FILTER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    chosen = exemplar_filter()
    assert (chosen is None) if sampled else isinstance(chosen, AlwaysOffExemplarFilter)
