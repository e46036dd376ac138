"""POST /v1/images/generations, POST /v1/images/edits (multipart), GET /v1/images/{sha256}."""

from __future__ import annotations

import time

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from fleet.gateway.guards import HttpError, parse, read_json, tenant_of
from fleet.gateway.image_bytes import image_format
from fleet.gateway.images import (
    IMAGE_FILE_FIELDS,
    ImageEditRequest,
    ImageGenerationRequest,
    edit_form_fields,
    image_edits_task,
    image_generation_task,
)
from fleet.gateway.openai_base import InvalidParameter
from fleet.gateway.renderers import ImageRenderer
from fleet.gateway.service import gateway_of, image_url_for, new_task_id, now_utc
from fleet.wire.cluster import ModelCard

MAX_INPUT_IMAGES = 8
# Stored images never change: the name is the hash of the bytes.
IMMUTABLE = {"cache-control": "public, max-age=31536000, immutable"}


def _default_size(card: ModelCard) -> str | None:
    return card.image_defaults.size if card.image_defaults else None


async def image_generations(request: Request) -> Response:
    gateway = gateway_of(request)
    ask = parse(ImageGenerationRequest, await read_json(request))
    card = gateway.card_for(ask.model, "text_to_image")
    timeout_s = gateway.timeout_for(ask.timeout)
    task_id = new_task_id("img")
    task = image_generation_task(ask, task_id, now_utc(), timeout_s, _default_size(card))
    renderer = ImageRenderer(
        gateway.backend, "image_generation", int(time.time()), ask.wants_url, image_url_for(request)
    )
    return await gateway.run(
        request, [task], renderer, stream=ask.stream, resumable=False, timeout_s=timeout_s,
        api="images.generations",
    )


async def _uploaded_images(request: Request) -> tuple[dict[str, str], list[bytes]]:
    limit = gateway_of(request).settings.gateway_max_body_bytes
    async with request.form(max_files=MAX_INPUT_IMAGES + 1, max_part_size=limit) as form:
        fields = edit_form_fields(form)
        files = [item for key in IMAGE_FILE_FIELDS for item in form.getlist(key)]
        if not files or not all(isinstance(item, UploadFile) for item in files):
            raise InvalidParameter("image: upload one or more image files", "image")
        if len(files) > MAX_INPUT_IMAGES:
            raise InvalidParameter(f"image: at most {MAX_INPUT_IMAGES} images", "image")
        images = [await item.read() for item in files if isinstance(item, UploadFile)]
    for data in images:
        if image_format(data) is None:
            raise InvalidParameter("image: only PNG, JPEG and WebP images are supported", "image")
    return fields, images


async def image_edits(request: Request) -> Response:
    gateway = gateway_of(request)
    fields, images = await _uploaded_images(request)
    ask = parse(ImageEditRequest, fields)
    card = gateway.card_for(ask.model, "image_to_image")
    hashes = [await gateway.backend.put_image(data) for data in images]
    for sha256 in hashes:
        await gateway.backend.owners.own_image(sha256, tenant_of(request))
    timeout_s = gateway.timeout_for(ask.timeout)
    task_id = new_task_id("img")
    task = image_edits_task(ask, task_id, hashes, now_utc(), timeout_s, _default_size(card))
    renderer = ImageRenderer(
        gateway.backend, "image_edit", int(time.time()), ask.wants_url, image_url_for(request)
    )
    return await gateway.run(
        request, [task], renderer, stream=ask.stream, resumable=False, timeout_s=timeout_s,
        api="images.edits",
    )


async def get_image(request: Request) -> Response:
    """An image the caller's tenant sent or made; another tenant's reads as missing (404).
    Bytes that do not hash to the name are refused (502, logged), never served."""
    sha256 = request.path_params["sha256"]  # the route admits only sha256 hex
    backend = gateway_of(request).backend
    missing = HttpError(404, f"no image {sha256} in this fleet")
    if not await backend.owners.owns_image(sha256, tenant_of(request)):
        raise missing
    data = await backend.get_image(sha256)
    if data is None:
        raise missing
    kind = image_format(data)
    media_type = f"image/{kind}" if kind else "application/octet-stream"
    return Response(data, media_type=media_type, headers=IMMUTABLE)
