"""The gateway's ASGI app: the route table, the middleware stack and the error handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from fleet import telemetry
from fleet.config import Settings
from fleet.dashboard import mount as mount_dashboard
from fleet.errors import FleetError
from fleet.gateway import docs, image_routes, ops_routes, text_routes
from fleet.gateway.backend import Backend
from fleet.gateway.guards import (
    ApiKeys,
    BodyLimit,
    BodyTimeout,
    on_client_disconnect,
    on_fleet_error,
    on_http_error,
    on_unexpected_error,
)
from fleet.gateway.service import Gateway
from fleet.gateway.tenants import KeyRing
from fleet.gateway.tracing import AccessLog, http_spans


class Sha256Convertor(Convertor[str]):
    """Only a hash names an image, so GET /v1/images/edits is a 405, not a bad image name."""

    regex = "[0-9a-f]{64}"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("sha256", Sha256Convertor())

ROUTES = [
    Route("/v1/chat/completions", text_routes.chat_completions, methods=["POST"]),
    Route("/v1/completions", text_routes.completions, methods=["POST"]),
    Route("/v1/responses", text_routes.responses, methods=["POST"]),
    Route("/v1/images/generations", image_routes.image_generations, methods=["POST"]),
    Route("/v1/images/edits", image_routes.image_edits, methods=["POST"]),
    Route("/v1/images/{sha256:sha256}", image_routes.get_image, methods=["GET"]),
    Route("/v1/models", ops_routes.list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", ops_routes.get_model, methods=["GET"]),
    Route("/v1/tasks/{task_id}/cancel", ops_routes.cancel_task, methods=["POST"]),
    Route("/v1/tasks/{task_id}/events", ops_routes.task_events, methods=["GET"]),
    Route("/healthz", ops_routes.healthz, methods=["GET"]),
    Route("/health", ops_routes.healthz, methods=["GET"]),  # the name many probes expect
    Route("/metrics", ops_routes.metrics, methods=["GET"]),
    Route("/openapi.json", ops_routes.openapi, methods=["GET"]),
]


def build_app(settings: Settings) -> Starlette:
    ring = KeyRing.load(settings.api_keys, settings.api_keys_file)
    gateway = Gateway(settings, Backend(settings))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.backend.start()
        await gateway.catalogue.start(wait_s=2.0 if gateway.backend.connected else 0.0)
        try:
            yield
        finally:
            await gateway.catalogue.close()
            await gateway.backend.close()
            gateway.metrics.meters.shutdown()

    app = Starlette(
        routes=[*ROUTES, *docs.routes()],
        middleware=[
            Middleware(ApiKeys, ring=ring, protect_metrics=settings.gateway_protect_metrics),
            Middleware(BodyTimeout, seconds=settings.gateway_body_timeout_s),
            Middleware(BodyLimit, max_bytes=settings.gateway_max_body_bytes),
        ],
        exception_handlers={
            ClientDisconnect: on_client_disconnect,
            FleetError: on_fleet_error,
            HTTPException: on_http_error,
            Exception: on_unexpected_error,
        },
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    app.state.key_ring = ring  # the dashboard asks it who is an operator
    mount_dashboard(app)  # /ui: fleet/dashboard
    # Outermost, in this order: the access log sees every request; the HTTP span is current
    # for everything below it. Added last so that they know every route, /ui's too.
    meter_provider = gateway.metrics.meters.provider
    app.add_middleware(http_spans, routes=app.router.routes, meter_provider=meter_provider)
    app.add_middleware(AccessLog)
    telemetry.export_to_nats(lambda: gateway.backend.nc)
    return app
