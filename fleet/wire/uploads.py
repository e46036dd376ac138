"""Image uploads for NATS users: a request on `fleet.images.put` whose body is the image's
bytes is answered by a worker, which stores it in FLEET_IMAGES under the sha256 of those
bytes (never replacing an object) and replies ImageStored, or UploadRefused."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from fleet.wire.base import Sha256Hex, Wire

IMAGE_UPLOAD = "fleet.images.put"
UPLOAD_QUEUE = "fleet-images"  # every worker listens; one stores each upload
SHA256_HEADER = "Fleet-Sha256"  # optional: the uploader's own hash, checked before storing


class ImageStored(Wire):
    type: Literal["image_stored"] = "image_stored"
    sha256: Sha256Hex = Field(description="the name to put in a task's input images")
    size: int = Field(ge=1)
    already_stored: bool = Field(description="an image with these bytes was there before")


class UploadRefused(Wire):
    type: Literal["upload_refused"] = "upload_refused"
    reason: Literal["empty", "digest_mismatch", "unavailable"]
    message: str


UploadReply = Annotated[ImageStored | UploadRefused, Field(discriminator="type")]
UPLOAD_REPLY: TypeAdapter[UploadReply] = TypeAdapter(UploadReply)
