"""Per-task metrics through the OpenTelemetry SDK, recorded by the worker from each task's
terminal event, with the GenAI conventions' names where they have one.

They leave only over OTLP (telemetry.setup installs a meter provider when an endpoint is
configured); otherwise the meters are the API's no-ops. The gateway's /metrics (Prometheus)
keeps its own view, timed from the client's side: these are the runner's times. The prefix
cache's hit ratio per model (cached / prompt tokens, from each terminal's usage) is a gauge
over this worker's totals, with the two counters beside it for a fleet-wide sum.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from fleet.wire.events import TaskFinished

# The conventions' advice for these histograms: from 1 ms to a minute.
LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60]


class TaskMetrics:
    def __init__(self, provider: metrics.MeterProvider | None = None) -> None:
        meter = metrics.get_meter("fleet.worker", meter_provider=provider)
        self._time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="From the runner taking a task to its first token",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self._time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Mean time between output tokens after the first",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self._queue_wait = meter.create_histogram(
            "fleet.task.queue_wait", unit="s",
            description="From the worker fetching a task to handing it to a runner",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self._prompt_tokens = meter.create_counter(
            "fleet.prefix_cache.prompt_tokens", unit="{token}",
            description="Prompt tokens of finished text tasks",
        )
        self._cached_tokens = meter.create_counter(
            "fleet.prefix_cache.cached_tokens", unit="{token}",
            description="Prompt tokens whose prefill a runner's prefix cache saved",
        )
        self.prompt_totals: dict[str, tuple[int, int]] = {}  # model -> (cached, prompt)
        meter.create_observable_gauge(
            "fleet.prefix_cache.hit_ratio", callbacks=[self._hit_ratios], unit="1",
            description="Cached / prompt tokens of the text tasks this worker finished",
        )

    def _hit_ratios(self, options: CallbackOptions) -> Iterable[Observation]:
        for model, (cached, prompt) in self.prompt_totals.items():
            if prompt:
                yield Observation(cached / prompt, {"gen_ai.request.model": model})

    def hit_ratio(self, model: str) -> float | None:
        cached, prompt = self.prompt_totals.get(model, (0, 0))
        return cached / prompt if prompt else None

    def finished(self, model: str, event: TaskFinished) -> None:
        if (usage := event.usage) is not None and usage.prompt_tokens:
            labels = {"gen_ai.request.model": model}
            self._prompt_tokens.add(usage.prompt_tokens, labels)
            self._cached_tokens.add(usage.cached_tokens, labels)
            cached, prompt = self.prompt_totals.get(model, (0, 0))
            self.prompt_totals[model] = (cached + usage.cached_tokens, prompt + usage.prompt_tokens)
        stats = event.stats
        if stats is None:
            return
        labels = {"gen_ai.request.model": model, "fleet.task.status": event.status}
        if stats.time_to_first_token_s is not None:
            self._time_to_first_token.record(stats.time_to_first_token_s, labels)
        if stats.tokens_per_s:
            self._time_per_output_token.record(1.0 / stats.tokens_per_s, labels)
        if stats.queue_wait_s is not None:
            self._queue_wait.record(stats.queue_wait_s, labels)
