"""The worker's image cache: files on local disk named by the sha256 hex of their bytes.

The cache is bounded in bytes and evicts the least recently used file first, except files that
an in-flight task has pinned. An input that is not on disk comes from the object store,
verified twice: the bytes against the stored digest, and the digest against the name. One that
is not in the store yet is waited for (the client may still be uploading), up to a bound, and
then fails the task with `input_missing`; a corrupt one fails it with `input_corrupt`.

A hit reads only the disk: no NATS traffic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path

from fleet.bus.objects import ObjectBucket
from fleet.errors import InputCorrupt, InputMissing, ObjectCorrupt, ObjectMissing, ObjectTimeout

log = logging.getLogger(__name__)

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ImageCache:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._pins: Counter[str] = Counter()
        directory.mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        """Adopt what an earlier run left, oldest use first; drop its unfinished downloads."""
        found: list[tuple[float, str, int]] = []
        for entry in os.scandir(self.directory):
            # Every temporary file here starts with a dot: this cache's unfinished downloads
            # and a killed runner's half-written output (`.<sha>.*.tmp`). No runner of this
            # worker runs yet, so none is in use.
            if entry.name.startswith("."):
                Path(entry.path).unlink(missing_ok=True)
            elif SHA256_HEX.fullmatch(entry.name) and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime, entry.name, stat.st_size))
        for _, sha, size in sorted(found):
            self._sizes[sha] = size
            self.total_bytes += size
        self._evict()

    def path(self, sha: str) -> Path:
        """Where the image with this hash lives, whether or not it is there yet."""
        if not SHA256_HEX.fullmatch(sha):
            raise ValueError(f"not a sha256 hex digest: {sha!r}")
        return self.directory / sha

    def __contains__(self, sha: str) -> bool:
        return sha in self._sizes

    def pin(self, hashes: Iterable[str]) -> None:
        """Keep these files until as many `release` calls; pins may nest."""
        self._pins.update(hashes)

    def release(self, hashes: Iterable[str]) -> None:
        self._pins.subtract(hashes)
        self._pins = +self._pins  # drop counts that reached zero
        self._evict()

    def adopt(self, sha: str) -> Path:
        """Register a file that someone else (a runner) placed at `path(sha)`. It is not
        hashed here: its upload checks the bytes against the name as it streams them (one
        hash on the way out, not three), and `discard` drops it when they differ."""
        path = self.path(sha)
        self._register(sha, path.stat().st_size)
        return path

    def discard(self, sha: str) -> None:
        """Forget and delete a file whose bytes proved not to be what its name says."""
        self.total_bytes -= self._sizes.pop(sha, 0)
        self.path(sha).unlink(missing_ok=True)

    async def ensure(
        self, hashes: Iterable[str], store: ObjectBucket, wait_s: float
    ) -> dict[str, Path]:
        """Make every image local and pin it; the caller `release`s them when its task ends.

        Raises InputMissing when an image is still not in the store `wait_s` seconds after the
        call, InputCorrupt when its bytes are wrong. Nothing stays pinned after a raise.
        """
        wanted = list(dict.fromkeys(hashes))
        for sha in wanted:
            self.path(sha)
        self.pin(wanted)
        try:
            deadline = asyncio.get_running_loop().time() + wait_s
            for sha in wanted:
                if not self._touch(sha):
                    await self._fetch(sha, store, deadline)
        except BaseException:
            self.release(wanted)
            raise
        return {sha: self.path(sha) for sha in wanted}

    async def _fetch(self, sha: str, store: ObjectBucket, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                info = await store.get_to_file(sha, self.path(sha))
                break
            except ObjectMissing:
                if not await _appears(store, sha, deadline - loop.time()):
                    raise InputMissing(
                        sha, f"input image {sha} is not in {store.bucket} after the bounded wait"
                    ) from None
            except ObjectCorrupt as exc:
                raise InputCorrupt(sha, f"input image {sha}: {exc.message}") from None
            except ObjectTimeout as exc:
                raise InputMissing(sha, f"input image {sha} could not be read: {exc.message}") \
                    from None
        if info.sha256 != bytes.fromhex(sha):
            self.path(sha).unlink(missing_ok=True)
            raise InputCorrupt(sha, f"object {sha} holds bytes with another sha256")
        self._register(sha, info.size)

    def _touch(self, sha: str) -> bool:
        """Mark a cached image as just used; False when it is not (or no longer) on disk."""
        if sha not in self._sizes:
            return False
        try:
            # The file's mtime carries the order of use across restarts (see _load).
            os.utime(self.path(sha))
        except FileNotFoundError:  # removed behind the cache's back: fetch it again
            self.total_bytes -= self._sizes.pop(sha)
            return False
        self._sizes.move_to_end(sha)
        return True

    def _register(self, sha: str, size: int) -> None:
        self.total_bytes += size - self._sizes.get(sha, 0)
        self._sizes[sha] = size
        self._sizes.move_to_end(sha)
        # The newcomer stays even when it alone breaks the budget: whoever added it wants it.
        self._evict(keep=sha)

    def _evict(self, keep: str | None = None) -> None:
        for sha in list(self._sizes):
            if self.total_bytes <= self.max_bytes:
                return
            if self._pins[sha] or sha == keep:
                continue
            self.total_bytes -= self._sizes.pop(sha)
            self.path(sha).unlink(missing_ok=True)
            log.debug("image cache: evicted %s", sha)
        if self.total_bytes > self.max_bytes:
            log.warning(
                "image cache: %d bytes in use by tasks in flight, over its %d-byte budget",
                self.total_bytes, self.max_bytes,
            )


async def _appears(store: ObjectBucket, sha: str, within: float) -> bool:
    if within <= 0:
        return False
    try:
        await store.wait_for(sha, within)
    except ObjectTimeout:
        return False
    return True
