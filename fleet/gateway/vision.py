"""The limits on a chat's input images, checked before any of them is stored.

A vision model's runner resizes every image to its tower's input (a few hundred pixels a
side), so a huge image buys nothing and costs the store, the node's fetch and the decode.
Each data-URL image is read only as far as its header (PIL's lazy open) for its size, then
verified whole; an image already stored in this fleet (a /v1/images/<sha256> URL) passed these
checks, or was made here, and is not read again. Every refusal is a 400 naming the image.
"""

from __future__ import annotations

import io

from fleet.errors import InvalidParameter, InvalidRequest
from fleet.gateway.bodies import image_reference

MAX_CHAT_IMAGES = 8
MAX_IMAGE_BYTES = 8 * 1024**2
MAX_IMAGE_PIXELS = 4096 * 4096


def check_chat_images(urls: list[str], param: str = "messages") -> None:
    """Raise InvalidParameter (400, naming `param`) for too many images, or one too large or
    unreadable."""
    if len(urls) > MAX_CHAT_IMAGES:
        raise InvalidParameter(
            f"{len(urls)} images in the chat; at most {MAX_CHAT_IMAGES} a request", param
        )
    for index, url in enumerate(urls):
        try:
            reference = image_reference(url)
        except InvalidRequest as exc:
            raise InvalidParameter(f"image {index}: {exc.message}", param) from None
        if isinstance(reference, bytes) and (why := image_refusal(reference)):
            raise InvalidParameter(f"image {index}: {why}", param)


def image_refusal(data: bytes) -> str | None:
    """Why these image bytes are refused, or None. Pure (reads only `data`)."""
    if len(data) > MAX_IMAGE_BYTES:
        return f"{len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}"
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                return (f"{width}x{height} pixels, over the limit of {MAX_IMAGE_PIXELS} "
                        "(4096x4096)")
            image.verify()  # the whole file, not only its header
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"the image could not be read ({exc})"
    return None
