"""Image bytes that arrive over HTTP: data URLs, URLs of images this gateway stores, and the
format sniffed from the bytes themselves."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Literal

from fleet.errors import InvalidRequest

_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[^,;]*)*?;base64,(?P<data>.*)$", re.S
)
_STORED_URL = re.compile(r"(?:^|/v1/images/)(?P<sha>[0-9a-f]{64})$")


def image_reference(url: str) -> str | bytes:
    """The sha256 of an image this gateway already stores, or the bytes of a data URL."""
    if stored := _STORED_URL.search(url):
        return stored["sha"]
    match = _DATA_URL.match(url)
    if not match:
        raise InvalidRequest(
            "image_url must be a base64 data: URL or a /v1/images/<sha256> URL of this gateway"
        )
    try:
        data = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("image_url: the data URL is not valid base64") from None
    if image_format(data) is None:
        raise InvalidRequest("image_url: only PNG, JPEG and WebP images are supported")
    return data


def image_format(data: bytes) -> Literal["png", "jpeg", "webp"] | None:
    """Sniff the format from magic bytes; never trust a declared content type."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None
