"""OpenAI image requests in, Fleet image tasks out; image events in, OpenAI image responses out.

Pure: the routes fetch and store bytes, these functions only shape requests and responses.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from fleet.errors import InvalidRequest
from fleet.gateway.openai import Seed, Timeout, deadline_after, invalid_from
from fleet.gateway.openai_base import OpenAIRequest
from fleet.wire.events import ImageChunk
from fleet.wire.tasks import ImageEdits, ImageGeneration

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
