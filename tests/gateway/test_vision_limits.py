"""The chat image limits as a table (pure: bytes in, a reason or None out)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from fleet.errors import InvalidParameter
from fleet.gateway.vision import MAX_CHAT_IMAGES, MAX_IMAGE_BYTES, check_chat_images, image_refusal


def encoded(size: tuple[int, int], fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 90)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(("make", "reason"), [
    (lambda: encoded((64, 48)), None),
    (lambda: encoded((64, 48), "JPEG"), None),
    (lambda: encoded((64, 48), "WEBP"), None),
    (lambda: encoded((4096, 4096)), None),  # exactly the limit
    (lambda: encoded((4097, 4096)), "4097x4096 pixels, over the limit"),
    (lambda: encoded((300, 300))[:200], "could not be read"),  # the header whole, the rest cut
    (lambda: b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "could not be read"),
    (lambda: b"\x89PNG" + b"\0" * MAX_IMAGE_BYTES, "over the limit of"),
], ids=["png", "jpeg", "webp", "at-the-pixel-limit", "over-the-pixel-limit", "truncated",
        "png-magic-only", "over-the-byte-limit"])
def test_image_refusal(make: object, reason: str | None) -> None:
    why = image_refusal(make())  # type: ignore[operator]
    assert why == reason if reason is None else why is not None and reason in why


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_the_count_and_each_images_index_are_named() -> None:
    small = data_url(encoded((4, 4)))
    check_chat_images([small] * MAX_CHAT_IMAGES)
    with pytest.raises(InvalidParameter, match=f"at most {MAX_CHAT_IMAGES}"):
        check_chat_images([small] * (MAX_CHAT_IMAGES + 1))
    with pytest.raises(InvalidParameter, match="image 1: the image could not be read") as bad:
        check_chat_images([small, data_url(b"\x89PNG\r\n\x1a\nx")], "images")
    assert bad.value.param == "images"
    # A URL of an image this gateway stores passed the checks when it was stored.
    check_chat_images(["http://gw/v1/images/" + "a" * 64])
