"""Uploading an image as a `client`: one request on `fleet.images.put` (fleet.worker.uploads).

The body is the whole image, so it must fit in one NATS message (the server's max_payload,
1 MiB by default); a larger image goes through the gateway's HTTP API, or is stored by a
role that may write FLEET_IMAGES itself (`fleet images put` with gateway, worker or operator
credentials writes it in chunks).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from fleet.bus.denials import refused_by_permission
from fleet.errors import NatsUnavailable, ObjectCorrupt, ObjectError, PayloadTooLarge
from fleet.wire.codec import DecodeError, decode_with
from fleet.wire.uploads import (
    IMAGE_UPLOAD,
    SHA256_HEADER,
    UPLOAD_REPLY,
    ImageStored,
    UploadRefused,
)

UPLOAD_TIMEOUT_S = 30.0


HEADERS_ROOM = 256  # the request's header block (Fleet-Sha256) travels in the same message


def fits_one_message(nc: Client, size: int) -> bool:
    return 0 < size <= nc.max_payload - HEADERS_ROOM


async def upload_image(
    nc: Client, source: bytes | Path, timeout: float = UPLOAD_TIMEOUT_S
) -> ImageStored:
    """Have a worker store the image; its answer names the image by its sha256."""
    body = source.read_bytes() if isinstance(source, Path) else source
    if not fits_one_message(nc, len(body)):
        raise PayloadTooLarge(
            f"an upload is one NATS message: {len(body)} bytes, and this server takes up to "
            f"{nc.max_payload - HEADERS_ROOM}; send a larger image through the gateway "
            "(/v1/images/edits)")
    sha256 = hashlib.sha256(body).hexdigest()
    try:
        # A role that may not upload (gateway, worker) hears so at once, not after `timeout`.
        reply = await refused_by_permission(lambda: nc.request(
            IMAGE_UPLOAD, body, timeout=timeout, headers={SHA256_HEADER: sha256}), IMAGE_UPLOAD)
    except NoRespondersError:
        raise NatsUnavailable(f"no worker answers {IMAGE_UPLOAD}: is a worker running?") from None
    except NatsTimeout:
        raise NatsUnavailable(f"no answer on {IMAGE_UPLOAD} within {timeout:g} s") from None
    try:
        answer = decode_with(UPLOAD_REPLY, reply.data)
    except DecodeError as exc:
        raise ObjectError(f"unreadable answer to an image upload: {exc}") from None
    if isinstance(answer, UploadRefused):
        raise ObjectError(f"the upload was refused ({answer.reason}): {answer.message}")
    if answer.sha256 != sha256:
        raise ObjectCorrupt(f"the worker stored {answer.sha256}, not {sha256}")
    return answer
