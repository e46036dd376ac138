"""The prefix cache's hit ratio per model, read through a real OpenTelemetry SDK reader."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fleet.wire.events import TaskFinished, Usage
from fleet.worker.task_metrics import TaskMetrics


def _finished(prompt: int, cached: int) -> TaskFinished:
    return TaskFinished(
        task_id="t", status="completed", at=0.0,
        usage=Usage(prompt_tokens=prompt, completion_tokens=4, total_tokens=prompt + 4,
                    cached_tokens=cached),
    )


def _points(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        str(point.attributes["gen_ai.request.model"]): point.value
        for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics
        if metric.name == name for point in metric.data.data_points  # type: ignore[union-attr]
    }


def test_hit_ratio_per_model() -> None:
    reader = InMemoryMetricReader()
    task_metrics = TaskMetrics(MeterProvider(metric_readers=[reader]))
    task_metrics.finished("tiny-llm", _finished(prompt=100, cached=0))
    task_metrics.finished("tiny-llm", _finished(prompt=300, cached=280))
    task_metrics.finished("smollm2-135m", _finished(prompt=50, cached=25))
    assert _points(reader, "fleet.prefix_cache.hit_ratio") == {
        "tiny-llm": 0.7, "smollm2-135m": 0.5,
    }
    assert _points(reader, "fleet.prefix_cache.cached_tokens") == {
        "tiny-llm": 280, "smollm2-135m": 25,
    }
    assert task_metrics.hit_ratio("tiny-llm") == 0.7
    assert task_metrics.hit_ratio("nobody") is None
