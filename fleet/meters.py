"""One metrics pipeline for every Fleet process: OpenTelemetry instruments, read out as
Prometheus text by the OpenTelemetry Prometheus exporter, and pushed over OTLP as well when an
endpoint is configured.

Why OpenTelemetry plus its Prometheus exporter rather than prometheus_client alone: the
worker's runner times already went out over OTLP, and one instrument now serves both a
collector and a scrape; the exporter writes the Prometheus spelling of the conventions' names
(dots to underscores, the unit as a suffix, `_total` on counters), so no name is hand-written.

Each component (the gateway, a worker) has its own MeterProvider and Prometheus registry: a
`fleet up` process runs both and each /metrics shows its own figures, and a test process that
builds many gateways sees each one's counts start at zero.

OTEL_SDK_DISABLED=true turns metrics off with the rest of the SDK: /metrics is then empty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Histogram, Meter
from opentelemetry.sdk.environment_variables import OTEL_METRICS_EXEMPLAR_FILTER
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, ExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest

from fleet.telemetry import operation_of, otlp_configured
from fleet.wire.events import TaskFinished
from fleet.wire.tasks import Task

# What /metrics says it is: the classic text format, which every Prometheus parses.
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class Meters:
    """A component's meter provider: a Prometheus reader on a registry of its own, plus an
    OTLP reader when OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT is set (the exporter reads the other
    OTEL_EXPORTER_OTLP_* and OTEL_METRIC_EXPORT_INTERVAL variables itself)."""

    def __init__(self, service_name: str, resource: Mapping[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        readers: list[MetricReader] = [PrometheusMetricReader(registry=self.registry)]
        if otlp_configured("METRICS"):
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        described = Resource.create({"service.name": service_name, **(resource or {})})
        # Shut down by its owner (the gateway's lifespan, the worker's run), not at exit:
        # an atexit hook per provider would keep every test's provider alive.
        self.provider = MeterProvider(
            metric_readers=readers, resource=described, shutdown_on_exit=False,
            exemplar_filter=exemplar_filter(),
        )

    def meter(self, name: str) -> Meter:
        return self.provider.get_meter(name)

    def exposition(self) -> bytes:
        """The Prometheus text of everything recorded; observable gauges are read now."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """The last OTLP export goes out; the registry stops answering."""
        self.provider.shutdown()


def exemplar_filter() -> ExemplarFilter | None:
    """Exemplars (a measurement's trace) only where something exports them: the Prometheus
    exporter drops them, so without OTLP metrics (or OTEL_METRICS_EXEMPLAR_FILTER set) none
    are sampled. The SDK's default samples one at every measurement made in a sampled span,
    every task's, ~2 us a measurement (issue 23). None: the SDK's default."""
    if otlp_configured("METRICS") or os.environ.get(OTEL_METRICS_EXEMPLAR_FILTER):
        return None
    return AlwaysOffExemplarFilter()


# ---- the histograms both sides record -------------------------------------------------------

# From a millisecond to a minute: local inference spans sub-millisecond tokens and
# multi-second first tokens (the conventions' advice starts at 1 ms as well).
LATENCY_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
]
# The GenAI conventions' advice for gen_ai.client.token.usage.
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304]

MODEL = "gen_ai.request.model"
OPERATION = "gen_ai.operation.name"
TOKEN_TYPE = "gen_ai.token.type"


def task_attributes(task: Task) -> dict[str, str]:
    """What every task histogram is split by: the conventions' model and operation."""
    return {MODEL: task.model, OPERATION: operation_of(task)}


class TaskTimings:
    """The histograms the gateway and the workers both record, under the same names: the
    gateway times a task as its client sees it (from the HTTP request), a worker as its runner
    ran it. The `otel_scope_name` label (fleet.gateway, fleet.worker) tells them apart."""

    def __init__(self, meter: Meter) -> None:
        def seconds(name: str, description: str) -> Histogram:
            return meter.create_histogram(
                name, unit="s", description=description,
                explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
            )

        self.time_to_first_token = seconds(
            "gen_ai.server.time_to_first_token",
            "Time to the first output token (or image) of a task",
        )
        self.time_per_output_token = seconds(
            "gen_ai.server.time_per_output_token",
            "Mean time between the output tokens of a task after the first",
        )
        # No GenAI or messaging convention names a queue's wait: Fleet's own name.
        self.queue_wait = seconds(
            "fleet.task.queue_wait", "Time a task waited before a runner took it"
        )
        self.request_duration = seconds(
            "gen_ai.server.request.duration", "Time from a task's start to its last event"
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Input and output tokens of a task",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )

    def finished(
        self, attributes: dict[str, str], seconds: float | None, finished: TaskFinished
    ) -> None:
        """A task's end: its duration (`seconds`, when known) with error.type on failure,
        and its token usage."""
        if seconds is not None:
            outcome = attributes
            if finished.status != "completed":
                reason = finished.reason
                outcome = {**attributes, "error.type": reason.value if reason else finished.status}
            self.request_duration.record(seconds, outcome)
        if usage := finished.usage:
            self.token_usage.record(usage.prompt_tokens, {**attributes, TOKEN_TYPE: "input"})
            self.token_usage.record(
                usage.completion_tokens, {**attributes, TOKEN_TYPE: "output"}
            )

