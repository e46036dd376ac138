"""Images to bytes and into the node's image cache, named by the sha256 of those bytes.

The name is the content's hash, so the bytes must depend on the pixels alone: Pillow writes no
timestamp, no EXIF and no text chunks unless asked, and the encoder settings are fixed here.
The same pixels then give the same hash on every node, which is what lets the object store and
the cache deduplicate.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from PIL import Image

from fleet.wire.events import ImageChunk, ImageStats

ImageFormat = Literal["png", "jpeg", "webp"]

# Fixed encoder settings: changing one changes every hash, so they live in one place.
_SAVE_OPTIONS: dict[ImageFormat, tuple[str, dict[str, object]]] = {
    "png": ("PNG", {"compress_level": 6}),
    "jpeg": ("JPEG", {"quality": 90, "subsampling": 0}),
    "webp": ("WEBP", {"quality": 90, "method": 4}),
}


@dataclass(frozen=True)
class StoredImage:
    sha256: str
    path: Path
    format: ImageFormat
    width: int
    height: int
    size_bytes: int

    def announced(
        self, task_id: str, image_index: int, stats: ImageStats | None = None,
        partial: tuple[int, int] | None = None,
    ) -> ImageChunk:
        """The `image` event that tells clients where this image is: its hash, never bytes."""
        return ImageChunk(
            task_id=task_id, at=time.time(), sha256=self.sha256, image_index=image_index,
            partial_index=partial[0] if partial else None,
            partial_total=partial[1] if partial else None,
            format=self.format, width=self.width, height=self.height,
            size_bytes=self.size_bytes, stats=stats,
        )


def encode_image(image: Image.Image, image_format: ImageFormat) -> bytes:
    """The image's bytes in `image_format`; the same pixels always give the same bytes."""
    pil_format, options = _SAVE_OPTIONS[image_format]
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format=pil_format, **options)
    return buffer.getvalue()


def store_image(image: Image.Image, image_format: ImageFormat, images_dir: Path) -> StoredImage:
    """Encode, hash and write the image to `images_dir/<sha256>`, atomically."""
    data = encode_image(image, image_format)
    sha256 = hashlib.sha256(data).hexdigest()
    path = images_dir / sha256
    if not path.exists():
        write_atomically(path, data)
    return StoredImage(
        sha256=sha256,
        path=path,
        format=image_format,
        width=image.width,
        height=image.height,
        size_bytes=len(data),
    )


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
