"""A worker's member of the `fleet-images` queue group: stores the images clients upload.

A `client` may not publish on `$O.FLEET_IMAGES.>` (whoever may write an object store's
chunks and descriptions may also delete or replace any object in it), so its images come
here: the request's body is the image, stored under the sha256 of the bytes through
`put_by_hash`, which never replaces an object, and the answer (ImageStored or UploadRefused)
goes only to an inbox (fleet.bus.replies), never to a subject the requester chose freely.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from fleet.bus.objects import ObjectBucket
from fleet.bus.replies import INBOX_ROOT, inbox_reply
from fleet.errors import FleetError
from fleet.wire.codec import encode
from fleet.wire.uploads import (
    IMAGE_UPLOAD,
    SHA256_HEADER,
    UPLOAD_QUEUE,
    ImageStored,
    UploadRefused,
)

log = logging.getLogger(__name__)


class Owner(Protocol):
    def spawn(self, name: str, coro: Any) -> Any: ...


def refusal(body: bytes, claimed: str | None) -> UploadRefused | None:
    """Why an upload cannot be stored as it is, or None. Pure."""
    if not body:
        return UploadRefused(reason="empty", message="the request's body is the image: empty")
    if claimed is not None and claimed != hashlib.sha256(body).hexdigest():
        return UploadRefused(reason="digest_mismatch", message=(
            f"the body's sha256 is not {SHA256_HEADER} {claimed[:80]!r}: changed on the way?"))
    return None


class ImageUploads:
    def __init__(self, nc: Client, store: ObjectBucket, owner: Owner) -> None:
        self.nc = nc
        self.store = store
        self.owner = owner
        self._subscription: Subscription | None = None
        # Workers upload nothing: an answer never goes into this role's own inboxes (its pulls
        # and requests), as for asks; none to keep out of without a role prefix.
        own = nc.new_inbox().rsplit(".", 1)[0]
        self.own_inboxes = own if own != INBOX_ROOT else None

    async def start(self) -> None:
        self._subscription = await self.nc.subscribe(
            IMAGE_UPLOAD, queue=UPLOAD_QUEUE, cb=self._take)

    async def close(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except (NatsError, OSError) as exc:
                log.warning("uploads: could not leave the queue group: %r", exc)

    async def _take(self, msg: Msg) -> None:
        reply = inbox_reply(msg.reply, self.own_inboxes)
        if reply is None:  # nobody to tell, or not a requester's inbox: store nothing
            log.warning("uploads: an upload without an inbox to answer (%r) was ignored",
                        (msg.reply or "")[:80])
            return
        self.owner.spawn("image upload", self._store(msg.data, msg.headers or {}, reply))

    async def _store(self, body: bytes, headers: dict[str, str], reply: str) -> None:
        answer: ImageStored | UploadRefused | None = refusal(body, headers.get(SHA256_HEADER))
        if answer is None:
            sha256 = hashlib.sha256(body).hexdigest()
            try:
                there = await self.store.find(sha256) is not None
                if not there:
                    await self.store.put_by_hash(body, sha256=sha256)
                answer = ImageStored(sha256=sha256, size=len(body), already_stored=there)
                log.info("uploads: image %s (%d bytes) %s", sha256, len(body),
                         "was already stored" if there else "stored")
            except FleetError as exc:
                answer = UploadRefused(reason="unavailable", message=exc.message)
        try:
            await self.nc.publish(reply, encode(answer))
        except (NatsError, OSError) as exc:
            log.warning("uploads: could not answer on %s: %r", reply, exc)
