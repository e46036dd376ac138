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
     └── ObjectTimeout   no answer, or no chunk for `timeout` seconds
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError
from nats.nuid import NUID

from fleet.bus.chunks import StoreRefused, publish_chunks, read_in_order
from fleet.errors import FleetError
from fleet.wire.subjects import IMAGES_BUCKET

MAX_CHUNK = 1024 * 1024  # the server's default max_payload, and the fastest size measured
DIGEST_PREFIX = "SHA-256="
ROLLUP = {"Nats-Rollup": "sub"}
STREAM_NOT_FOUND = 10059
PARTIAL_SUFFIX = ".part"  # a download in progress, beside where it will land


class ObjectError(FleetError):
    pass


class BucketMissing(ObjectError):
    pass


class ObjectMissing(ObjectError):
    pass


class ObjectExists(ObjectError):
    pass


class ObjectCorrupt(ObjectError):
    pass


class ObjectTimeout(ObjectError):
    pass


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    nuid: str
    size: int
    chunks: int
    digest: str
    mtime: str = ""
    deleted: bool = False

    @property
    def sha256(self) -> bytes:
        encoded = self.digest[len(DIGEST_PREFIX) :]
        if self.digest[: len(DIGEST_PREFIX)].upper() != DIGEST_PREFIX or not encoded:
            raise ObjectCorrupt(f"{self.name}: unsupported digest {self.digest!r}")
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))

    @classmethod
    def from_json(cls, raw: bytes) -> ObjectInfo:
        try:
            meta = json.loads(raw)
            return cls(
                name=meta["name"], nuid=meta.get("nuid") or "", size=meta.get("size") or 0,
                chunks=meta.get("chunks") or 0, digest=meta.get("digest") or "",
                mtime=meta.get("mtime") or "", deleted=bool(meta.get("deleted")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ObjectCorrupt(f"unreadable object description: {exc}") from None

    def to_json(self, bucket: str, chunk_size: int) -> bytes:
        meta = {
            "name": self.name, "options": {"max_chunk_size": chunk_size}, "bucket": bucket,
            "nuid": self.nuid, "size": self.size, "mtime": self.mtime, "chunks": self.chunks,
            "digest": self.digest,
        }
        return json.dumps(meta).encode()


def sha256_hex(source: bytes | Path) -> str:
    if isinstance(source, Path):
        with source.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    return hashlib.sha256(source).hexdigest()


@contextlib.contextmanager
def _translated(bucket: str, name: str) -> Iterator[None]:
    """nats-py's errors, as the object store's own."""
    try:
        yield
    except NotFoundError as exc:
        if exc.err_code == STREAM_NOT_FOUND:
            raise BucketMissing(f"object store bucket {bucket} does not exist") from None
        raise ObjectMissing(f"object {name} not found in {bucket}") from None
    except NoStreamResponseError:
        raise BucketMissing(f"object store bucket {bucket} does not exist") from None
    except (TimeoutError, NoRespondersError) as exc:
        raise ObjectTimeout(f"object {name} in {bucket}: {type(exc).__name__}") from None
    except APIError as exc:
        raise ObjectError(f"object {name} in {bucket}: {exc.description or exc}") from None
    except StoreRefused as exc:
        raise ObjectError(f"{bucket} refused object {name}: {exc}") from None


class ObjectBucket:
    """One object store bucket. `timeout` bounds every wait: each API call, each chunk ack, and
    the silence between two chunks of a read."""

    def __init__(self, nc: Client, bucket: str = IMAGES_BUCKET, *, timeout: float = 5.0) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout)
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        self.timeout = timeout
        self._nuid = NUID()

    def meta_subject(self, name: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    def chunk_subject(self, nuid: str) -> str:
        return f"$O.{self.bucket}.C.{nuid}"

    async def find(self, name: str) -> ObjectInfo | None:
        """The object's description, or None when it is absent or deleted."""
        try:
            with _translated(self.bucket, name):
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
                with _translated(self.bucket, name):
                    async for raw in descriptions:
                        if not (info := ObjectInfo.from_json(raw)).deleted:
                            return info
        except TimeoutError:
            pass
        raise ObjectTimeout(f"object {name} did not appear within {timeout:g} s")

    async def get(self, name: str) -> bytes:
        parts: list[bytes] = []
        await self._read(await self.info(name), parts.append)
        return b"".join(parts)

    async def get_to_file(self, name: str, path: Path) -> ObjectInfo:
        """Stream the object into `path` through a temporary file beside it, renamed when whole
        and verified; nothing is left behind on failure."""
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
        digest = hashlib.sha256()
        size = 0
        if info.chunks:
            subject = self.chunk_subject(info.nuid)
            chunks = read_in_order(
                self.nc, self.js, self.stream, subject, self.timeout, count=info.chunks
            )
            with _translated(self.bucket, info.name):
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        digest.update(chunk)
                        size += len(chunk)
                        sink(chunk)
        if size != info.size or digest.digest() != info.sha256:
            raise ObjectCorrupt(
                f"object {info.name}: read {size} bytes that do not match its digest "
                f"{info.digest} and size {info.size}"
            )

    async def put(self, name: str, source: bytes | Path) -> ObjectInfo:
        """Store a new object from bytes or a file, in chunks of up to 1 MiB."""
        if await self.find(name) is not None:
            raise ObjectExists(f"object {name} is already stored in {self.bucket}")
        return await self._write(name, source, expected_sha256=None)

    async def put_by_hash(self, source: bytes | Path) -> str:
        """Store bytes or a file under the sha256 hex of its content unless already stored."""
        name = await asyncio.to_thread(sha256_hex, source)
        if await self.find(name) is None:
            await self._write(name, source, expected_sha256=bytes.fromhex(name))
        return name

    async def _write(
        self, name: str, source: bytes | Path, expected_sha256: bytes | None
    ) -> ObjectInfo:
        nuid = self._nuid.next().decode()
        subject = self.chunk_subject(nuid)
        chunk_size = min(MAX_CHUNK, self.nc.max_payload)
        try:
            with _translated(self.bucket, name), _pieces(source, chunk_size) as pieces:
                written = await publish_chunks(self.nc, subject, pieces, self.timeout)
            if expected_sha256 is not None and written.sha256 != expected_sha256:
                raise ObjectCorrupt(f"{name}: the file changed while it was being uploaded")
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
        with _translated(self.bucket, name):
            await self.js.publish(
                self.meta_subject(name), info.to_json(self.bucket, chunk_size), headers=ROLLUP
            )
        return info

    async def list(self) -> list[ObjectInfo]:
        """Every stored object, by name. One request per object: for operators, not hot paths."""
        with _translated(self.bucket, "*"):
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
