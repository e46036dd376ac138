"""`python -m bench.http_middleware`: the CPU the gateway's outer middleware costs: the HTTP
server span and metrics (OpenTelemetry's ASGI instrumentation) and the access log, per request
and per streamed chunk, against the bare app; and the CPU of one /metrics render.

In one process, no sockets: a stand-in route streams N SSE-sized chunks; the tracer provider
is the SDK's (spans are recorded, exported nowhere), so what a real gateway pays per span is in.
Process CPU time, the least of several rounds: on a shared machine wall time is mostly others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import telemetry
from fleet.gateway.backend import ModelQueue
from fleet.gateway.observability import AccessLog, GatewayMetrics, http_spans

CHUNK = {"type": "http.response.body", "body": b'data: {"choices":[]}\n\n', "more_body": True}


def streaming_app(chunks: int) -> tuple[ASGIApp, list[Route]]:
    route = Route("/v1/chat/completions", lambda request: None, methods=["POST"])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = route
        headers = [(b"x-fleet-task-id", b"chatcmpl-1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(chunks):
            await send(CHUNK)
        await send({"type": "http.response.body", "body": b""})

    return app, [route]


def request_scope() -> Scope:
    return {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
        "headers": [(b"host", b"gateway"), (b"content-length", b"80")], "query_string": b"",
        "scheme": "http", "http_version": "1.1", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    pass


async def cpu_per_request(app: ASGIApp, requests: int, rounds: int) -> float:
    """Seconds of process CPU per request, the least over `rounds`."""
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(requests):
            await app(request_scope(), _receive, _send)
        best = min(best, (time.process_time() - started) / requests)
    return best


async def run(requests: int, rounds: int, chunks: int) -> dict[str, Any]:
    metrics = GatewayMetrics()
    result: dict[str, Any] = {}
    for n in (0, chunks):
        bare, routes = streaming_app(n)
        wrapped = AccessLog(http_spans(bare, routes, metrics.meters.provider))
        base = await cpu_per_request(bare, requests, rounds)
        full = await cpu_per_request(wrapped, requests, rounds)
        result[f"overhead_us_per_request_{n}_chunks"] = (full - base) * 1e6
    per_chunk = (result[f"overhead_us_per_request_{chunks}_chunks"]
                 - result["overhead_us_per_request_0_chunks"]) / chunks
    result["overhead_us_per_chunk"] = per_chunk
    queues = {f"model-{i}": ModelQueue(queued=i) for i in range(8)}
    started = time.process_time()
    for _ in range(requests):
        metrics.render(queues, waiting=1)
    result["metrics_render_us"] = (time.process_time() - started) / requests * 1e6
    result["load_1m"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = parser.parse_args()
    telemetry.setup("bench-gateway")  # the SDK's tracer, as `fleet gateway` has
    result = asyncio.run(run(args.requests, args.rounds, args.chunks))
    for key, value in result.items():
        print(f"{key}: {value:.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
