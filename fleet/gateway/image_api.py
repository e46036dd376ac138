"""The image API: POST /v1/images/generations, POST /v1/images/edits (multipart),
GET /v1/images/{sha256}; OpenAI image requests in, Fleet image tasks out, image events
in, OpenAI image responses out.

Only the routes fetch and store bytes; the functions that shape requests and responses are
pure. OpenAI's image responses carry base64 while Fleet's events carry hashes, so the
renderer reads each image's bytes from FLEET_IMAGES.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from fleet.bus.task_events import Indexed
from fleet.errors import FleetError, HttpError, InvalidParameter, InvalidRequest, NatsUnavailable
from fleet.gateway.auth import tenant_of
from fleet.gateway.backend import Backend
from fleet.gateway.bodies import (
    OpenAIRequest,
    Seed,
    Timeout,
    deadline_after,
    image_format,
    parse,
    read_json,
)
from fleet.gateway.errors import invalid_from
from fleet.gateway.relay import sse, sse_error
from fleet.gateway.service import gateway_of, image_url_for, new_task_id, now_utc
from fleet.wire.cluster import ModelCard
from fleet.wire.events import (
    ImageChunk,
    OutputEvent,
)
from fleet.wire.tasks import ImageEdits, ImageGeneration

MAX_INPUT_IMAGES = 8


# Stored images never change: the name is the hash of the bytes. With API keys an image is its
# tenant's: a shared cache must not hand it to another tenant, so only the client may keep it.
IMMUTABLE = {"cache-control": "public, max-age=31536000, immutable"}
TENANTS_ONLY = {"cache-control": "private, max-age=31536000, immutable"}


def _default_size(card: ModelCard) -> str | None:
    return card.image_defaults.size if card.image_defaults else None


async def image_generations(request: Request) -> Response:
    gateway = gateway_of(request)
    ask = parse(ImageGenerationRequest, await read_json(request))
    card = gateway.card_for(ask.model, "text_to_image")
    ask = ask.model_copy(update={"model": card.id})  # an alias asks for its model
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
    ask = ask.model_copy(update={"model": card.id})  # an alias asks for its model
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
    tenant = tenant_of(request)
    if not await backend.owners.owns_image(sha256, tenant):
        raise missing
    data = await backend.get_image(sha256)
    if data is None:
        raise missing
    kind = image_format(data)
    media_type = f"image/{kind}" if kind else "application/octet-stream"
    return Response(data, media_type=media_type,
                    headers=IMMUTABLE if tenant is None else TENANTS_ONLY)


ImageSizeIn = Annotated[str, Field(pattern=r"^(auto|[1-9][0-9]{1,4}x[1-9][0-9]{1,4})$")]


StreamKind = Literal["image_generation", "image_edit"]


class ImageGenerationRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)
    prompt: str = Field(min_length=1, max_length=32000)
    n: int = Field(default=1, ge=1, le=8)
    size: ImageSizeIn = "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    stream: bool = False
    partial_images: int = Field(default=0, ge=0, le=8)
    seed: Seed | None = Field(default=None, description="Fleet: same seed, same bytes")
    steps: int | None = Field(default=None, ge=1, le=200, description="Fleet extension")
    guidance: float | None = Field(default=None, ge=0.0, le=50.0, description="Fleet extension")
    timeout: Timeout | None = None

    @property
    def wants_url(self) -> bool:
        return self.response_format == "url"


class ImageEditRequest(ImageGenerationRequest):
    """The non-file fields of the multipart form; the files arrive as `image` or `image[]`."""

    strength: float = Field(default=0.6, gt=0.0, le=1.0, description="Fleet: how far to move")


IMAGE_FILE_FIELDS = ("image", "image[]")


def _image_fields(
    request: ImageGenerationRequest, default_size: str | None, now: datetime, timeout_s: float
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": request.model,
        "prompt": request.prompt,
        "n": request.n,
        "output_format": request.output_format,
        "partial_images": request.partial_images if request.stream else 0,
        "deadline": deadline_after(now, timeout_s),
        "created_at": now,
        "seed": request.seed,
        "steps": request.steps,
        "guidance": request.guidance,
        "size": default_size if request.size == "auto" else request.size,
    }
    return {name: value for name, value in fields.items() if value is not None}


def image_generation_task(
    request: ImageGenerationRequest,
    task_id: str,
    now: datetime,
    timeout_s: float,
    default_size: str | None = None,
) -> ImageGeneration:
    try:
        return ImageGeneration(
            task_id=task_id, **_image_fields(request, default_size, now, timeout_s)
        )
    except ValidationError as exc:
        raise invalid_from(exc) from None


def image_edits_task(
    request: ImageEditRequest,
    task_id: str,
    input_images: list[str],
    now: datetime,
    timeout_s: float,
    default_size: str | None = None,
) -> ImageEdits:
    try:
        return ImageEdits(
            task_id=task_id,
            input_images=input_images,
            strength=request.strength,
            **_image_fields(request, default_size, now, timeout_s),
        )
    except ValidationError as exc:
        raise invalid_from(exc) from None


def edit_form_fields(form: Mapping[str, Any]) -> dict[str, Any]:
    """The text fields of an edit form; a mask is refused rather than silently ignored."""
    if "mask" in form:
        raise InvalidRequest("mask: masked (inpainting) edits are not supported by Fleet")
    return {k: v for k, v in form.items() if k not in IMAGE_FILE_FIELDS and isinstance(v, str)}


def encode_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _size(chunk: ImageChunk) -> str:
    return f"{chunk.width}x{chunk.height}"


def _zero_usage() -> dict[str, Any]:
    # OpenAI's SDK models require usage on completed events; Fleet does not count image tokens.
    details = {"image_tokens": 0, "text_tokens": 0}
    return {
        "input_tokens": 0,
        "input_tokens_details": details,
        "output_tokens": 0,
        "total_tokens": 0,
    }


def stream_event(
    chunk: ImageChunk, b64: str, kind: StreamKind, created: int, url: str
) -> tuple[str, dict[str, Any]]:
    """An image event as OpenAI's (event name, data) for a partial image or a final one."""
    body: dict[str, Any] = {
        "b64_json": b64,
        "created_at": created,
        "size": _size(chunk),
        "quality": "auto",
        "background": "auto",
        "output_format": chunk.format,
        "image_index": chunk.image_index,
        "sha256": chunk.sha256,
        "url": url,
    }
    if chunk.partial_index is not None:
        name = f"{kind}.partial_image"
        body["partial_image_index"] = chunk.partial_index
    else:
        name = f"{kind}.completed"
        body["usage"] = _zero_usage()
    return name, {"type": name, **body}


def images_response(
    finals: list[ImageChunk],
    created: int,
    wants_url: bool,
    b64_by_sha: Mapping[str, str],
    url_of: Mapping[str, str],
) -> dict[str, Any]:
    """The non-streaming response: final images in index order, as base64 or as URLs."""
    ordered = sorted(finals, key=lambda chunk: chunk.image_index)
    data = [
        {"url": url_of[chunk.sha256]} if wants_url else {"b64_json": b64_by_sha[chunk.sha256]}
        for chunk in ordered
    ]
    response: dict[str, Any] = {"created": created, "data": data}
    if ordered:
        response["output_format"] = ordered[0].format
        response["size"] = _size(ordered[0])
    return response


class ImageRenderer:
    def __init__(
        self,
        backend: Backend,
        kind: StreamKind,
        created: int,
        wants_url: bool,
        url_of: Callable[[str], str],
    ) -> None:
        self.backend = backend
        self.kind = kind
        self.created = created
        self.wants_url = wants_url
        self.url_of = url_of

    async def _b64(self, sha256: str) -> str:
        data = await self.backend.get_image(sha256)
        if data is None:
            raise NatsUnavailable(f"image {sha256} was announced but is not in the store")
        return encode_b64(data)

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        finals = [e for e in events if isinstance(e, ImageChunk) and e.partial_index is None]
        hashes = {chunk.sha256 for chunk in finals}
        b64 = {} if self.wants_url else {sha: await self._b64(sha) for sha in hashes}
        urls = {sha: self.url_of(sha) for sha in hashes}
        return images_response(finals, self.created, self.wants_url, b64, urls)

    def opening(self) -> list[bytes]:
        return []

    async def lines(self, item: Indexed) -> list[bytes]:
        chunk = item.event
        if not isinstance(chunk, ImageChunk):
            return []
        b64 = await self._b64(chunk.sha256)
        name, data = stream_event(chunk, b64, self.kind, self.created, self.url_of(chunk.sha256))
        return [sse(data, event=name, event_id=item.index)]

    def closing(self) -> list[bytes]:
        return []

    def failed(self, exc: FleetError) -> list[bytes]:
        return [sse_error(exc)]
