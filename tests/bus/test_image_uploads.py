"""Images cannot be deleted or replaced by a `client` (issue 31, item 4): the probes that
worked before (a description marked deleted, a roll-up of an object's chunks or description)
are refused by the server, and the honest path (an upload a worker stores by hash, then a
read) works. Real nats-server on the shipped roles."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from nats.aio.client import Client

from fleet.aio import Supervisor
from fleet.bus import denials
from fleet.bus.connect import ConnectOptions, connect
from fleet.bus.objects import ObjectBucket
from fleet.bus.provision import provision
from fleet.bus.uploads import upload_image
from fleet.errors import NotPermitted, PayloadTooLarge
from fleet.wire.uploads import IMAGE_UPLOAD, SHA256_HEADER
from fleet.worker.uploads import ImageUploads, refusal
from tests.secured import PASSWORDS, as_role, shipped_auth_server

VICTIM = b"someone else's input image"
VICTIM_SHA = hashlib.sha256(VICTIM).hexdigest()


@pytest.mark.parametrize(("body", "claimed", "reason"), [
    (b"png bytes", None, None),
    (b"png bytes", hashlib.sha256(b"png bytes").hexdigest(), None),
    (b"", None, "empty"),
    (b"png bytes", "0" * 64, "digest_mismatch"),
])
def test_refusal(body: bytes, claimed: str | None, reason: str | None) -> None:
    refused = refusal(body, claimed)
    assert (refused.reason if refused else None) == reason


@pytest.fixture(scope="module")
def secured_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shipped_auth_server(tmp_path_factory.mktemp("images")) as url:
        asyncio.run(_prepare(url))
        yield url


async def _prepare(url: str) -> None:
    admin = await as_role(url, "operator")
    try:
        await provision(admin)
        await ObjectBucket(admin).put_by_hash(VICTIM)
    finally:
        await admin.close()


@pytest.fixture
async def worker(secured_url: str) -> AsyncIterator[Client]:
    """A worker's upload responder, under the worker role."""
    nc = await as_role(secured_url, "worker")
    async with Supervisor("test-uploads") as owner:
        uploads = ImageUploads(nc, ObjectBucket(nc), owner)
        await uploads.start()
        yield nc
        await uploads.close()
        await owner.cancel_all()
    await nc.close()


async def _refused(nc: Client, violations: list[str], subject: str, *,
                   headers: dict[str, str] | None = None, body: bytes = b"{}") -> None:
    await nc.publish(subject, body, headers=headers)
    await nc.flush()
    async with asyncio.timeout(5):
        while not any(subject.lower() in v.lower() for v in violations):
            await nc.flush()
    assert any(subject.lower() in v.lower() for v in violations)


async def test_a_client_cannot_delete_or_replace_an_image(secured_url: str) -> None:
    violations: list[str] = []
    nc = await as_role(secured_url, "client", violations)
    try:
        bucket = ObjectBucket(nc)
        info = await bucket.info(VICTIM_SHA)
        meta = bucket.meta_subject(VICTIM_SHA)
        deleted = json.dumps({"name": VICTIM_SHA, "bucket": "FLEET_IMAGES", "deleted": True})
        await _refused(nc, violations, meta, body=deleted.encode())
        await _refused(nc, violations, meta, headers={"Nats-Rollup": "sub"})
        await _refused(nc, violations, bucket.chunk_subject(info.nuid),
                       headers={"Nats-Rollup": "sub"})
        for api in ("STREAM.PURGE.OBJ_FLEET_IMAGES", "STREAM.MSG.DELETE.OBJ_FLEET_IMAGES"):
            await _refused(nc, violations, f"$JS.API.{api}", body=b'{"seq": 1}')
        assert await bucket.get(VICTIM_SHA) == VICTIM  # still there, whole
    finally:
        await nc.close()


async def test_a_client_uploads_through_a_worker_and_reads_it_back(
    secured_url: str, worker: Client
) -> None:
    nc = await as_role(secured_url, "client")
    try:
        image = b"\x89PNG a client's input image"
        stored = await upload_image(nc, image)
        assert stored.sha256 == hashlib.sha256(image).hexdigest()
        assert not stored.already_stored
        assert await ObjectBucket(nc).get(stored.sha256) == image
        assert (await upload_image(nc, image)).already_stored  # never re-put
        again = await upload_image(nc, VICTIM)
        assert again.already_stored and again.sha256 == VICTIM_SHA
    finally:
        await nc.close()


async def test_an_upload_too_large_for_one_message_says_where_to_send_it(
    secured_url: str,
) -> None:
    nc = await as_role(secured_url, "client")
    try:
        with pytest.raises(PayloadTooLarge, match="gateway"):
            await upload_image(nc, b"x" * nc.max_payload)
    finally:
        await nc.close()


async def test_an_upload_is_answered_only_on_an_inbox(secured_url: str, worker: Client) -> None:
    """The responder's grants reach FLEET_OUT and the workers' own inboxes (their pulls): a
    reply pointed there gets nothing written, and the image is not stored for a requester
    that cannot hear the answer."""
    admin = await as_role(secured_url, "operator")
    client = await as_role(secured_url, "client")
    try:
        body = b"pointed at someone's output"
        watched = await admin.subscribe("_INBOX.worker.its-pull-inbox")
        await admin.flush()
        for hostile in ("fleet.out.victim-task", "_INBOX.worker.its-pull-inbox"):
            await client.publish(IMAGE_UPLOAD, body, reply=hostile,
                                 headers={SHA256_HEADER: hashlib.sha256(body).hexdigest()})
        await client.flush()
        # callbacks run in order: once a later upload is answered, that one was handled
        assert (await upload_image(client, b"a later honest upload")).sha256
        info: Any = await admin.jetstream().stream_info("FLEET_OUT",
                                                       subjects_filter="fleet.out.victim-task")
        assert not info.state.subjects
        await admin.flush()
        assert watched.pending_msgs == 0
        assert await ObjectBucket(admin).find(hashlib.sha256(body).hexdigest()) is None
    finally:
        await client.close()
        await admin.close()


async def test_a_client_writing_the_store_itself_is_refused_at_once(secured_url: str) -> None:
    """`fleet images put` with client credentials and no worker falls back to writing the
    chunks: the server refuses, and the caller hears it at once, not after the retry budget."""
    nc = await connect(secured_url, "test-client", inbox_owner="client",
                       options=ConnectOptions(user="client", password=PASSWORDS["client"]))
    try:
        async with asyncio.timeout(5):
            with pytest.raises(NotPermitted, match=r"(?i)fleet_images"):
                await ObjectBucket(nc).put_by_hash(b"written by a client itself")
    finally:
        await nc.close()
        denials.forget_permission_errors()
