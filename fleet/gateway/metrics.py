"""Prometheus text exposition for the gateway: counters and histograms kept in memory.

Small on purpose: three metric kinds, labels as sorted tuples, rendered on scrape. Gauges that
come from JetStream (queue depth per model) are passed in at scrape time, not stored.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleet.wire.events import ImageChunk, OutputEvent, TaskFinished, TokenChunk

if TYPE_CHECKING:
    from fleet.gateway.backend import ModelQueue

Labels = tuple[tuple[str, str], ...]

# Latencies of local inference span sub-millisecond tokens to multi-second first tokens.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _labels(values: Mapping[str, str]) -> Labels:
    return tuple(sorted((key, str(value)) for key, value in values.items()))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _render_labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = [*labels, extra] if extra else list(labels)
    if not pairs:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in pairs) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class Counter:
    name: str
    help: str
    values: dict[Labels, float] = field(default_factory=lambda: defaultdict(float))

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[_labels(labels)] += amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_render_labels(labels)} {_number(value)}"


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: dict[Labels, list[int]] = field(default_factory=dict)
    sums: dict[Labels, float] = field(default_factory=lambda: defaultdict(float))

    def observe(self, value: float, **labels: str) -> None:
        key = _labels(labels)
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[key] += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for labels, counts in sorted(self.counts.items()):
            cumulative = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == float("inf") else _number(bound)
                yield f"{self.name}_bucket{_render_labels(labels, ('le', le))} {cumulative}"
            yield f"{self.name}_sum{_render_labels(labels)} {_number(self.sums[labels])}"
            yield f"{self.name}_count{_render_labels(labels)} {cumulative}"


def render_gauge(name: str, help: str, values: Mapping[Labels, float]) -> Iterable[str]:
    yield f"# HELP {name} {help}"
    yield f"# TYPE {name} gauge"
    for labels, value in sorted(values.items()):
        yield f"{name}{_render_labels(labels)} {_number(value)}"


class GatewayMetrics:
    """Everything /metrics reports that the gateway itself observes."""

    def __init__(self) -> None:
        self.requests = Counter("fleet_gateway_requests_total", "HTTP requests by route and status")
        self.errors = Counter("fleet_gateway_errors_total", "Failed requests and tasks by reason")
        self.tokens = Counter("fleet_gateway_tokens_total", "Tokens by model and kind")
        self.ttft = Histogram(
            "fleet_gateway_time_to_first_token_seconds",
            "From the request to the first token or image seen by the gateway",
        )
        self.tpot = Histogram(
            "fleet_gateway_time_per_output_token_seconds",
            "Mean time between output tokens of one task after the first",
        )
        self.duration = Histogram(
            "fleet_gateway_request_duration_seconds", "From the request to its last byte"
        )

    def render(self, queues: Mapping[str, ModelQueue], waiting: int = 0) -> str:
        """`waiting`: requests now waiting on task events (their limit answers 429); a total,
        so an open /metrics names no tenant."""
        def per_model(field: str) -> dict[Labels, float]:
            return {_labels({"model": m}): getattr(q, field) for m, q in queues.items()}

        lines = [
            *self.requests.render(),
            *self.errors.render(),
            *self.tokens.render(),
            *self.ttft.render(),
            *self.tpot.render(),
            *self.duration.render(),
            *render_gauge(
                "fleet_gateway_waiting_requests",
                "Requests waiting on task events (chats in flight, event streams)",
                {(): waiting},
            ),
            *render_gauge(
                "fleet_queue_depth", "Tasks in FLEET_TASKS not yet acknowledged, per model",
                per_model("queued"),
            ),
            *render_gauge(
                "fleet_tasks_in_flight", "Tasks handed to a worker and not acknowledged yet",
                per_model("in_flight"),
            ),
            *render_gauge(
                "fleet_tasks_redelivered",
                "Tasks in flight that were handed out more than once (a worker died or stalled)",
                per_model("redelivered"),
            ),
            *render_gauge(
                "fleet_tasks_dead_lettered", "Tasks in FLEET_DEAD after their last delivery",
                per_model("dead_lettered"),
            ),
        ]
        return "\n".join(lines) + "\n"


class TaskObserver:
    """Times one task's events as the gateway relays them (monotonic seconds in, no clock here)."""

    def __init__(self, metrics: GatewayMetrics, model: str, started: float) -> None:
        self.metrics = metrics
        self.model = model
        self.started = started
        self.first_output: float | None = None
        self.last_token: float | None = None
        self.token_count = 0

    def see(self, event: OutputEvent, now: float) -> None:
        match event:
            case TokenChunk() | ImageChunk() if self.first_output is None:
                self.first_output = now
                self.metrics.ttft.observe(now - self.started, model=self.model)
        if isinstance(event, TokenChunk):
            self.token_count += 1
            self.last_token = now
        if isinstance(event, TaskFinished):
            self.finish(event)

    def finish(self, finished: TaskFinished) -> None:
        if self.token_count > 1 and self.first_output is not None and self.last_token is not None:
            mean = (self.last_token - self.first_output) / (self.token_count - 1)
            self.metrics.tpot.observe(mean, model=self.model)
        if finished.usage:
            self.metrics.tokens.inc(finished.usage.prompt_tokens, model=self.model, kind="prompt")
            self.metrics.tokens.inc(
                finished.usage.completion_tokens, model=self.model, kind="completion"
            )
