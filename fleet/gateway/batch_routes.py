"""The routes of /v1/files and /v1/batches, and the runner of batch jobs an app owns."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.bus.batch_store import BatchStore
from fleet.gateway import batch_api, files_api
from fleet.gateway.batch_runner import BatchRunner
from fleet.gateway.idempotency import Endpoint, idempotent
from fleet.gateway.service import Gateway


def by_method(**endpoints: Endpoint) -> Endpoint:
    """One endpoint per path for several methods: a 405 then lists every allowed method."""

    async def route(request: Request) -> Response:
        return await endpoints[request.method.lower()](request)

    return route


def batch_routes() -> list[Route]:
    return [
        Route("/v1/files", by_method(post=idempotent(files_api.upload_file),
                                     get=files_api.list_files), methods=["GET", "POST"]),
        Route("/v1/files/{file_id}", by_method(get=files_api.get_file,
                                               delete=files_api.delete_file),
              methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", files_api.file_content, methods=["GET"]),
        Route("/v1/batches", by_method(post=idempotent(batch_api.create_batch),
                                       get=batch_api.list_batches), methods=["GET", "POST"]),
        Route("/v1/batches/{batch_id}", batch_api.get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batch_api.cancel_batch, methods=["POST"]),
    ]


def batch_runner(gateway: Gateway) -> BatchRunner:
    """Started and closed with the app (its lifespan): see fleet.gateway.batch_runner."""
    return BatchRunner(gateway, BatchStore(gateway.backend._client))
