"""Fleet's object store client, in the layout nats-py's ObjectStore and Go's `nats object` use.

One bucket B is the stream OBJ_B. An object's bytes are the messages on `$O.B.C.<nuid>`, in
order. Its description is the last message on `$O.B.M.<base64url(name)>` (published with a
subject rollup): JSON with name, bucket, nuid, size, chunks, mtime and digest
"SHA-256=<base64url>". Chunks move through fleet.bus.chunks.

Objects are never replaced: replacing re-uploads every chunk and strands a reader that is
still reading the old ones. `put` refuses an existing name and `put_by_hash` skips it.

    ObjectError (FleetError)
     ├── BucketMissing   the bucket's stream does not exist
     ├── ObjectMissing   no such object, or it was deleted
     ├── ObjectExists    `put` of a name that is already stored
     ├── ObjectCorrupt   the bytes differ from the recorded size or digest
     │    └── ImageCorrupt   an image whose bytes do not hash to its name (input_corrupt)
     └── ObjectTimeout   no answer, or no chunk for `timeout` seconds

In FLEET_IMAGES an object's name is the sha256 hex of its bytes, and a reader trusts that
name (immutable caches, the worker's input cache): every read by name there checks that the
recorded digest is the name, before a byte is handed out, and the bytes against the digest.

Reads and writes retry under the broker policy (fleet.bus.retry) while the connection is
down or was replaced during the attempt; a stall on a healthy connection is final.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client
from nats.nuid import NUID

from fleet.bus.chunks import publish_chunks, read_in_order
from fleet.bus.denials import refused_by_permission
from fleet.bus.object_info import (
    DIGEST_PREFIX,
    ObjectInfo,
    StalledOnBroker,
    recorded_hex,
    sha256_hex,
    translated_errors,
)
from fleet.bus.retry import BROKER_BUDGET_S, with_retry
from fleet.errors import (
    BrokerUnavailable,
    BucketMissing,
    ImageCorrupt,
    NotPermitted,
    ObjectCorrupt,
    ObjectError,
    ObjectExists,
    ObjectMissing,
    ObjectTimeout,
)
from fleet.wire.subjects import IMAGES_BUCKET

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CHUNK = 1024 * 1024  # the server's default max_payload, and the fastest size measured
ROLLUP = {"Nats-Rollup": "sub"}
PARTIAL_SUFFIX = ".part"  # a download in progress, beside where it will land
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ObjectBucket:
    """One object store bucket. `timeout` bounds every wait: each API call, each chunk ack, and
    the silence between two chunks of a read."""

    def __init__(
        self,
        nc: Client,
        bucket: str = IMAGES_BUCKET,
        *,
        timeout: float = 5.0,
        budget_s: float = BROKER_BUDGET_S,
        named_by_hash: bool | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout)
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        self.timeout = timeout
        self.budget_s = budget_s
        # FLEET_IMAGES names every object by its bytes' sha256; other buckets need not.
        self.named_by_hash = bucket == IMAGES_BUCKET if named_by_hash is None else named_by_hash
        self._nuid = NUID()

    async def _retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """`call` under the broker retry policy: a timeout is retried only when the connection
        dropped or was replaced meanwhile (a restart), never on a healthy one."""

        async def once() -> T:
            epoch = self.nc.stats["reconnects"]
            try:
                return await call()
            except ObjectTimeout as exc:
                healthy = self.nc.is_connected and self.nc.stats["reconnects"] == epoch
                if healthy and not exc.transient:
                    raise
                raise StalledOnBroker(exc.message) from None

        try:
            return await with_retry(once, what=what, budget_s=self.budget_s)
        except BrokerUnavailable as exc:
            raise ObjectTimeout(f"{what}: {exc}") from None

    def _check_name(self, info: ObjectInfo) -> None:
        """In a bucket named by hash, the recorded digest must be the name."""
        if not self.named_by_hash:
            return
        if SHA256_HEX.fullmatch(info.name) and info.sha256 == bytes.fromhex(info.name):
            return
        log.error(
            "refused object %s in %s: its recorded sha256 is %s, not its name",
            info.name, self.bucket, recorded_hex(info),
        )
        raise ImageCorrupt(
            f"object {info.name} in {self.bucket} holds bytes whose sha256 is "
            f"{recorded_hex(info)}, not its name; refused"
        )

    def meta_subject(self, name: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    def chunk_subject(self, nuid: str) -> str:
        return f"$O.{self.bucket}.C.{nuid}"

    async def find(self, name: str) -> ObjectInfo | None:
        """The object's description, or None when it is absent or deleted."""
        return await self._retrying(lambda: self._find(name), f"look up {name} in {self.bucket}")

    async def _find(self, name: str) -> ObjectInfo | None:
        try:
            with translated_errors(self.bucket, name):
                msg = await self.js.get_last_msg(self.stream, self.meta_subject(name))
        except ObjectMissing:
            return None
        info = ObjectInfo.from_json(msg.data or b"")
        return None if info.deleted else info

    async def info(self, name: str) -> ObjectInfo:
        found = await self.find(name)
        if found is None:
            raise ObjectMissing(f"object {name} not found in {self.bucket}")
        return found

    async def wait_for(self, name: str, timeout: float) -> ObjectInfo:
        """The object's description as soon as it is stored; ObjectTimeout after `timeout`."""
        if found := await self.find(name):
            return found
        # A consumer, not a plain subscription plus a look: a description published just
        # before the look may be routed but not yet stored, and then neither would see it.
        descriptions = read_in_order(
            self.nc, self.js, self.stream, self.meta_subject(name), timeout, from_last=True
        )
        try:
            async with asyncio.timeout(timeout), contextlib.aclosing(descriptions):
                with translated_errors(self.bucket, name):
                    async for raw in descriptions:
                        if not (info := ObjectInfo.from_json(raw)).deleted:
                            return info
        except TimeoutError:
            pass
        raise ObjectTimeout(f"object {name} did not appear within {timeout:g} s")

    async def get(self, name: str) -> bytes:
        """The object's bytes, verified (and, by hash, checked against the name)."""

        async def once() -> bytes:
            parts: list[bytes] = []
            await self._read(await self.info(name), parts.append)
            return b"".join(parts)

        return await self._retrying(once, f"read {name} from {self.bucket}")

    async def get_to_file(self, name: str, path: Path) -> ObjectInfo:
        """Stream the object into `path` through a temporary file beside it, renamed when whole
        and verified; nothing is left behind on failure."""
        return await self._retrying(
            lambda: self._get_to_file(name, path), f"read {name} from {self.bucket}"
        )

    async def _get_to_file(self, name: str, path: Path) -> ObjectInfo:
        info = await self.info(name)
        partial = path.with_name(f".{path.name}.{self._nuid.next().decode()}{PARTIAL_SUFFIX}")
        try:
            with partial.open("wb") as file:
                # Writes are 1 MiB into the page cache: cheaper inline than a thread hop each.
                await self._read(info, file.write)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return info

    async def _read(self, info: ObjectInfo, sink: Callable[[bytes], object]) -> None:
        self._check_name(info)
        digest = hashlib.sha256()
        size = 0
        if info.chunks:
            subject = self.chunk_subject(info.nuid)
            chunks = read_in_order(
                self.nc, self.js, self.stream, subject, self.timeout, count=info.chunks
            )
            with translated_errors(self.bucket, info.name):
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        digest.update(chunk)
                        size += len(chunk)
                        sink(chunk)
        if size != info.size or digest.digest() != info.sha256:
            if self.named_by_hash:
                log.error("refused object %s in %s: its bytes hash to %s", info.name,
                          self.bucket, digest.hexdigest())
            raise (ImageCorrupt if self.named_by_hash else ObjectCorrupt)(
                f"object {info.name}: read {size} bytes that do not match its digest "
                f"{info.digest} and size {info.size}"
            )

    async def put(self, name: str, source: bytes | Path) -> ObjectInfo:
        """Store a new object from bytes or a file, in chunks of up to 1 MiB."""
        if await self.find(name) is not None:
            raise ObjectExists(f"object {name} is already stored in {self.bucket}")
        tries = 0

        async def once() -> ObjectInfo:
            nonlocal tries
            tries += 1
            if tries > 1 and (stored := await self._find(name)) is not None:
                return stored  # the last try stored it; only its answer was lost
            return await self._write(name, source, expected_sha256=None)

        return await self._retrying(once, f"store {name} in {self.bucket}")

    async def put_by_hash(self, source: bytes | Path, *, sha256: str | None = None) -> str:
        """Store bytes or a file under the sha256 hex of its content unless already stored.
        A caller that knows the hash passes it: the upload checks it as it streams the bytes
        (ObjectCorrupt when they differ), so the source is read once."""
        name = sha256 or await asyncio.to_thread(sha256_hex, source)

        async def once() -> None:
            if await self._find(name) is None:  # again on a retry: the last try may have stored it
                await self._write(name, source, expected_sha256=bytes.fromhex(name))

        await self._retrying(once, f"store {name} in {self.bucket}")
        return name

    async def _write(
        self, name: str, source: bytes | Path, expected_sha256: bytes | None
    ) -> ObjectInfo:
        nuid = self._nuid.next().decode()
        subject = self.chunk_subject(nuid)
        chunk_size = min(MAX_CHUNK, self.nc.max_payload)
        try:
            with translated_errors(self.bucket, name), _pieces(source, chunk_size) as pieces:
                # A role that may not write the store (a `client`) hears so at once
                # (NotPermitted), rather than wait out the acks and the broker budget.
                written = await refused_by_permission(
                    lambda: publish_chunks(self.nc, subject, pieces, self.timeout), subject)
            if expected_sha256 is not None and written.sha256 != expected_sha256:
                raise ObjectCorrupt(
                    f"{name}: the bytes uploaded do not hash to the name (misnamed, or changed "
                    "while being uploaded)"
                )
        except NotPermitted:
            raise  # its chunks were refused, none stored: nothing to purge (nor may it)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.js.purge_stream(self.stream, subject=subject)
            raise
        info = ObjectInfo(
            name=name, nuid=nuid, size=written.size, chunks=written.chunks,
            digest=DIGEST_PREFIX + base64.urlsafe_b64encode(written.sha256).decode(),
            mtime=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        )
        # No purge once the description may be out: a lost ack can hide a stored object.
        with translated_errors(self.bucket, name):
            await self.js.publish(
                self.meta_subject(name), info.to_json(self.bucket, chunk_size), headers=ROLLUP
            )
        return info

    async def list(self) -> list[ObjectInfo]:
        """Every stored object, by name. One request per object: for operators, not hot paths."""
        with translated_errors(self.bucket, "*"):
            stream = await self.js.stream_info(self.stream, subjects_filter=f"$O.{self.bucket}.M.>")
            found = [
                ObjectInfo.from_json((await self.js.get_last_msg(self.stream, subject)).data or b"")
                for subject in stream.state.subjects or {}
            ]
        return sorted((info for info in found if not info.deleted), key=lambda info: info.name)


@contextlib.contextmanager
def _pieces(source: bytes | Path, chunk_size: int) -> Iterator[Iterator[bytes | memoryview]]:
    if isinstance(source, Path):
        with source.open("rb") as file:
            yield iter(lambda: file.read(chunk_size), b"")
    else:
        view = memoryview(source)
        yield (view[start : start + chunk_size] for start in range(0, len(view), chunk_size))




__all__ = [
    "MAX_CHUNK", "ROLLUP", "BucketMissing", "ImageCorrupt", "ObjectBucket", "ObjectCorrupt",
    "ObjectError", "ObjectExists", "ObjectInfo", "ObjectMissing", "ObjectTimeout", "sha256_hex",
]
