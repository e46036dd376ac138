"""The fleet-wide half of the vision cache: a node's encoded image features, shared through
the FLEET_VISION object store.

A vision runner writes each image's features into the node's features directory
(fleet/bus/vision_layout.py). Before a task is dispatched the worker places there, from the
store, the entries of the task's images that another node made (`prefetch`), so the runner skips the
encoder; after a task ends it stores the entries this node made (`share`), once each.
Sharing is an optimisation: a miss, a slow store or a refusal costs an encode, never the
task. The object store checks each object's digest on read; a bad entry is dropped as a miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from nats.aio.client import Client

from fleet.aio import started
from fleet.bus.objects import ObjectBucket
from fleet.bus.vision_layout import entry, features_dir, object_name
from fleet.errors import ObjectError, ObjectMissing

log = logging.getLogger(__name__)

BUCKET = "FLEET_VISION"
PREFETCH_S = 5.0  # longer than an encode of a few images takes: the store is then no help


class VisionShare:
    def __init__(self, nc: Client, images_dir: Path) -> None:
        self.directory = features_dir(images_dir)
        self.store = ObjectBucket(nc, BUCKET, named_by_hash=False, timeout=2.0, budget_s=2.0)
        self._shared: set[str] = set()  # object names known to be in the store
        self._uploads: set[asyncio.Task[None]] = set()
        self._warned = False

    def _fingerprints(self) -> list[str]:
        """The fingerprints of the vision models whose runners ran on this node."""
        if not self.directory.is_dir():
            return []
        return sorted({path.read_text().strip() for path in self.directory.glob("*.key")})

    async def prefetch(self, hashes: Iterable[str]) -> int:
        """Place the store's entries for these images that this node lacks; how many came."""
        wanted = list(hashes)
        if not wanted:
            return 0
        try:
            return await asyncio.wait_for(self._prefetch(wanted), PREFETCH_S)
        except (TimeoutError, ObjectError, OSError) as exc:
            self._warn("prefetch", exc)
            return 0

    async def _prefetch(self, hashes: list[str]) -> int:
        came = 0
        for fp in self._fingerprints():
            for sha in hashes:
                path = entry(self.directory, fp, sha)
                if path.exists():
                    continue
                name = object_name(fp, sha)
                try:
                    await self.store.get_to_file(name, path)
                except ObjectMissing:
                    continue
                self._shared.add(name)
                came += 1
        return came

    def share(self, hashes: Iterable[str]) -> None:
        """Store, beside the loop, the entries of these images this node made."""
        names = [(fp, sha) for fp in self._fingerprints() for sha in hashes
                 if object_name(fp, sha) not in self._shared
                 and entry(self.directory, fp, sha).exists()]
        if names:
            task = started(self._upload(names), "share vision features")
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    async def _upload(self, names: list[tuple[str, str]]) -> None:
        for fp, sha in names:
            name = object_name(fp, sha)
            try:
                if await self.store.find(name) is None:
                    await self.store.put(name, entry(self.directory, fp, sha))
            except (ObjectError, OSError) as exc:
                self._warn("share", exc)
                return
            self._shared.add(name)

    async def drain(self) -> None:
        """Wait for the uploads under way (tests, and a worker that stops)."""
        if self._uploads:
            await asyncio.gather(*self._uploads, return_exceptions=True)

    def _warn(self, what: str, exc: BaseException) -> None:
        # Once: a fleet without the bucket (or a role without its grant) would say it per task.
        if not self._warned:
            self._warned = True
            log.warning("vision cache: %s through %s failed (%s); this node encodes images "
                        "the fleet already encoded", what, BUCKET, exc)
