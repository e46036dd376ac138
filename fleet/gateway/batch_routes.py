"""The routes of /v1/files and /v1/batches, and the runner of batch jobs an app owns."""

from __future__ import annotations

from starlette.routing import Route

from fleet.bus.batch_store import BatchStore
from fleet.gateway import batch_api, files_api
from fleet.gateway.batch_runner import BatchRunner
from fleet.gateway.idempotency import idempotent
from fleet.gateway.service import Gateway


def batch_routes() -> list[Route]:
    return [
        Route("/v1/files", idempotent(files_api.upload_file), methods=["POST"]),
        Route("/v1/files", files_api.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", files_api.get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", files_api.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", files_api.file_content, methods=["GET"]),
        Route("/v1/batches", idempotent(batch_api.create_batch), methods=["POST"]),
        Route("/v1/batches", batch_api.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", batch_api.get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batch_api.cancel_batch, methods=["POST"]),
    ]


def batch_runner(gateway: Gateway) -> BatchRunner:
    """Started and closed with the app (its lifespan): see fleet.gateway.batch_runner."""
    return BatchRunner(gateway, BatchStore(gateway.backend._client))
