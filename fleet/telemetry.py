"""OpenTelemetry: trace context into and out of NATS headers and runner frames."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.context import Context


def inject_headers(headers: MutableMapping[str, str]) -> None:
    propagate.inject(headers)


def extract_context(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {}))


def current_context() -> Context:
    return otel_context.get_current()
