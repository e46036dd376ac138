"""The object store's descriptions, errors and error translation (see fleet.bus.objects).

    ObjectError (FleetError)
     ├── BucketMissing   the bucket's stream does not exist
     ├── ObjectMissing   no such object, or it was deleted
     ├── ObjectExists    `put` of a name that is already stored
     ├── ObjectCorrupt   the bytes differ from the recorded size or digest
     │    └── ImageCorrupt   an image whose bytes do not hash to its name (input_corrupt)
     └── ObjectTimeout   no answer, or no chunk for `timeout` seconds
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from fleet.bus.chunks import StoreRefused
from fleet.errors import BucketMissing, ObjectCorrupt, ObjectError, ObjectMissing, ObjectTimeout

DIGEST_PREFIX = "SHA-256="
STREAM_NOT_FOUND = 10059


class StalledOnBroker(NatsTimeout):
    """An object read or write that stalled while the connection was down: retry it."""


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
def translated_errors(bucket: str, name: str) -> Iterator[None]:
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
        # A request nobody answered is the broker's trouble; a read that went idle is not.
        transient = isinstance(exc, NatsTimeout | NoRespondersError)
        raise ObjectTimeout(
            f"object {name} in {bucket}: {type(exc).__name__}", transient=transient
        ) from None
    except APIError as exc:
        if exc.code == 503:  # no stream leader: an election
            raise ObjectTimeout(f"object {name} in {bucket}: {exc}", transient=True) from None
        raise ObjectError(f"object {name} in {bucket}: {exc.description or exc}") from None
    except StoreRefused as exc:
        raise ObjectError(f"{bucket} refused object {name}: {exc}") from None


def recorded_hex(info: ObjectInfo) -> str:
    try:
        return info.sha256.hex()
    except ObjectCorrupt:
        return repr(info.digest)
