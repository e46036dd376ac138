"""For the tracing tests: a real OTLP/HTTP receiver, `fleet gateway` as a process, and a
reader that follows one trace's subject in FLEET_TRACES until the spans a test expects are in.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from fleet.wire import subjects

Spans = list[dict[str, Any]]


def service_of(resource: Resource) -> str:
    return next(a.value.string_value for a in resource.attributes if a.key == "service.name")


class OtlpReceiver:
    """Collects what a collector would see: spans POSTed to /v1/traces (service.name, name,
    ids) and the names of metrics POSTed to /v1/metrics, by service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, str]] = []
        self.metrics: set[tuple[str, str]] = set()  # (service, metric name)
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/metrics":
                    metrics = ExportMetricsServiceRequest.FromString(body)
                    receiver._add_metrics(metrics)
                    answer = ExportMetricsServiceResponse().SerializeToString()
                else:
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                    answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        with self._changed:
            for resource_spans in request.resource_spans:
                service = service_of(resource_spans.resource)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "service": service, "name": span.name,
                            "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                        })
            self._changed.notify_all()

    def _add_metrics(self, request: ExportMetricsServiceRequest) -> None:
        with self._changed:
            for resource_metrics in request.resource_metrics:
                service = service_of(resource_metrics.resource)
                for scope_metrics in resource_metrics.scope_metrics:
                    self.metrics |= {(service, metric.name) for metric in scope_metrics.metrics}
            self._changed.notify_all()

    def wait_for(self, done: Callable[[OtlpReceiver], bool], timeout: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: done(self), timeout):
                raise TimeoutError(f"the OTLP receiver has {self.spans}, {self.metrics}")

    @contextmanager
    def running(self) -> Iterator[OtlpReceiver]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


def otlp_env(endpoint: str) -> dict[str, str]:
    # Short export delays: the receiver sees spans and metrics within a moment, not after
    # the defaults' 5 s and 60 s.
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
    }


async def trace_spans(
    nc: Client, trace_id: str, done: Callable[[Spans], bool], timeout: float = 60.0
) -> Spans:
    """Follow `fleet.traces.<trace_id>` from its first stored message until `done(spans)`."""
    found: Spans = []
    complete = asyncio.Event()

    async def on_batch(msg: Msg) -> None:
        found.extend(orjson.loads(msg.data)["spans"])
        if done(found):
            complete.set()

    sub = await nc.jetstream().subscribe(
        subjects.traces(trace_id), stream=subjects.TRACES_STREAM, ordered_consumer=True,
        cb=on_batch,
    )
    try:
        await asyncio.wait_for(complete.wait(), timeout)
    except TimeoutError:
        raise TimeoutError(f"trace {trace_id} has only {[s['name'] for s in found]}") from None
    finally:
        await sub.unsubscribe()
    return found


def by_name(spans: Spans) -> dict[str, dict[str, Any]]:
    return {span["name"]: span for span in spans}


def has(*names: str) -> Callable[[Spans], bool]:
    return lambda spans: set(names) <= {span["name"] for span in spans}
