"""Fleet's object store reader and writer against a real nats-server, and against nats-py's
stock ObjectStore on the same bucket (both directions)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from fleet.bus import images_cli
from fleet.bus.chunks import read_in_order
from fleet.bus.objects import MAX_CHUNK, ROLLUP, ObjectBucket, ObjectInfo
from fleet.errors import (
    BucketMissing,
    ImageCorrupt,
    ObjectCorrupt,
    ObjectError,
    ObjectExists,
    ObjectMissing,
    ObjectTimeout,
)
from fleet.wire.events import ErrorReason
from fleet.wire.subjects import IMAGES_BUCKET

# Generic behaviour is tested on a bucket whose names are free; FLEET_IMAGES (names are the
# bytes' sha256) has its own tests at the end.
BUCKET = "FLEET_TEST_OBJECTS"
# Waits that must end by themselves; the guard only turns a hang into a failure.
TIMEOUT_S = 0.5
HANG_GUARD_S = 20.0


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
async def stock(nc: Client) -> ObjectStore:
    return await nc.jetstream().create_object_store(BUCKET)


@pytest.fixture
def bucket(nc: Client, stock: ObjectStore) -> ObjectBucket:
    return ObjectBucket(nc, BUCKET, timeout=TIMEOUT_S * 4)


async def rewrite_meta(bucket: ObjectBucket, info: ObjectInfo, **changes: object) -> None:
    """Publish a doctored description of an existing object, as a broken writer might."""
    doctored = dataclasses.replace(info, **changes)
    await bucket.js.publish(
        bucket.meta_subject(info.name), doctored.to_json(bucket.bucket, MAX_CHUNK), headers=ROLLUP
    )


async def stream_messages(bucket: ObjectBucket) -> int:
    return (await bucket.js.stream_info(bucket.stream)).state.messages


@pytest.mark.parametrize(
    "size", [0, 1, MAX_CHUNK, MAX_CHUNK + 1, 32 * 1024 * 1024], ids=lambda n: f"{n}B"
)
async def test_round_trip(bucket: ObjectBucket, size: int) -> None:
    data = os.urandom(size)
    info = await bucket.put("object", data)
    assert (info.size, info.chunks) == (size, -(-size // MAX_CHUNK))
    assert await bucket.get("object") == data


async def test_get_to_file_streams_and_leaves_only_the_file(
    bucket: ObjectBucket, tmp_path: Path
) -> None:
    data = os.urandom(3 * MAX_CHUNK + 5)
    sha = await bucket.put_by_hash(data)
    target = tmp_path / "out" / sha
    target.parent.mkdir()
    info = await bucket.get_to_file(sha, target)
    assert target.read_bytes() == data
    assert info.sha256.hex() == sha
    assert os.listdir(target.parent) == [sha]


async def test_put_from_a_file(bucket: ObjectBucket, tmp_path: Path) -> None:
    source = tmp_path / "image.bin"
    source.write_bytes(os.urandom(2 * MAX_CHUNK + 3))
    sha = await bucket.put_by_hash(source)
    assert sha == hashlib.sha256(source.read_bytes()).hexdigest()
    assert await bucket.get(sha) == source.read_bytes()


async def test_stock_nats_py_reads_what_fleet_wrote(
    bucket: ObjectBucket, stock: ObjectStore
) -> None:
    data = os.urandom(2 * MAX_CHUNK + 7)
    ours = await bucket.put("from-fleet", data)
    result = await asyncio.wait_for(stock.get("from-fleet"), HANG_GUARD_S)
    assert result.data == data
    assert (result.info.size, result.info.chunks, result.info.digest) == (
        ours.size, ours.chunks, ours.digest,
    )


async def test_fleet_reads_what_stock_nats_py_wrote(
    bucket: ObjectBucket, stock: ObjectStore
) -> None:
    data = os.urandom(5 * 128 * 1024 + 11)  # stock chunks are 128 KiB: six of them
    await stock.put("from-stock", data)
    info = await bucket.info("from-stock")
    assert (info.size, info.chunks) == (len(data), 6)
    assert await bucket.get("from-stock") == data


async def test_missing_and_deleted_objects(bucket: ObjectBucket, stock: ObjectStore) -> None:
    with pytest.raises(ObjectMissing):
        await bucket.get("never-stored")
    await stock.put("short-lived", b"bytes")
    await stock.delete("short-lived")
    assert await bucket.find("short-lived") is None
    with pytest.raises(ObjectMissing):
        await bucket.get("short-lived")


async def test_a_missing_bucket_is_named(nc: Client) -> None:
    with pytest.raises(BucketMissing):
        await ObjectBucket(nc, "NO_SUCH_BUCKET").get("anything")


async def test_wrong_digest_in_the_description_is_corrupt(
    bucket: ObjectBucket, tmp_path: Path
) -> None:
    info = await bucket.put("object", os.urandom(MAX_CHUNK + 1))
    wrong = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(b"other").digest()).decode()
    await rewrite_meta(bucket, info, digest=wrong)
    with pytest.raises(ObjectCorrupt):
        await bucket.get("object")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with pytest.raises(ObjectCorrupt):
        await bucket.get_to_file("object", downloads / "object")
    assert os.listdir(downloads) == []


async def test_a_replaced_chunk_is_corrupt(bucket: ObjectBucket) -> None:
    info = await bucket.put("object", b"a" * 100)
    chunk = await bucket.js.get_last_msg(bucket.stream, bucket.chunk_subject(info.nuid))
    await bucket.js.delete_msg(bucket.stream, chunk.seq)
    await bucket.js.publish(bucket.chunk_subject(info.nuid), b"b" * 100)
    with pytest.raises(ObjectCorrupt):
        await bucket.get("object")


async def test_missing_chunks_end_in_a_timeout_not_a_hang(bucket: ObjectBucket) -> None:
    info = await bucket.put("object", os.urandom(2 * MAX_CHUNK))
    await rewrite_meta(bucket, info, chunks=3)
    impatient = ObjectBucket(bucket.nc, bucket.bucket, timeout=TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(ObjectTimeout):
        await asyncio.wait_for(impatient.get("object"), HANG_GUARD_S)
    assert time.monotonic() - started < TIMEOUT_S + 2.0


async def test_objects_are_never_put_twice(bucket: ObjectBucket) -> None:
    data = os.urandom(MAX_CHUNK + 1)
    sha = await bucket.put_by_hash(data)
    stored = await stream_messages(bucket)
    assert await bucket.put_by_hash(data) == sha
    assert await stream_messages(bucket) == stored
    with pytest.raises(ObjectExists):
        await bucket.put(sha, data)
    assert await stream_messages(bucket) == stored


async def test_wait_for_wakes_on_the_put(bucket: ObjectBucket) -> None:
    waiting = asyncio.create_task(bucket.wait_for("late", timeout=HANG_GUARD_S))
    stored = await bucket.put("late", b"arrived")
    assert await asyncio.wait_for(waiting, HANG_GUARD_S) == stored
    with pytest.raises(ObjectTimeout):
        await bucket.wait_for("never", timeout=0.1)


async def test_list_names_what_is_stored(bucket: ObjectBucket, stock: ObjectStore) -> None:
    await bucket.put("b-object", b"2")
    await stock.put("a-object", b"1")
    await stock.put("deleted", b"3")
    await stock.delete("deleted")
    assert [info.name for info in await bucket.list()] == ["a-object", "b-object"]


def test_description_json_is_the_go_and_nats_py_layout() -> None:
    info = ObjectInfo("name", "NUID", 3, 1, "SHA-256=abc=", mtime="2024-01-01T00:00:00Z")
    assert json.loads(info.to_json("B", MAX_CHUNK)) == {
        "name": "name", "bucket": "B", "nuid": "NUID", "size": 3, "chunks": 1,
        "digest": "SHA-256=abc=", "mtime": "2024-01-01T00:00:00Z",
        "options": {"max_chunk_size": MAX_CHUNK},
    }
    assert ObjectInfo.from_json(info.to_json("B", MAX_CHUNK)) == info


async def test_a_reader_whose_consumer_vanishes_resumes_after_the_last_chunk(
    bucket: ObjectBucket,
) -> None:
    data = os.urandom(6 * MAX_CHUNK)
    info = await bucket.put("object", data)
    subject = bucket.chunk_subject(info.nuid)
    chunks = read_in_order(
        bucket.nc, bucket.js, bucket.stream, subject, HANG_GUARD_S, count=info.chunks
    )
    received: list[bytes] = []
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            received.append(chunk)
            if len(received) == 1:  # an operator (or a server restart) removes the consumer
                for consumer in await bucket.js.consumers_info(bucket.stream):
                    await bucket.js.delete_consumer(bucket.stream, consumer.name)
    assert b"".join(received) == data


def test_images_cli_puts_gets_and_lists(
    nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def create_bucket() -> None:
        client = await nats.connect(nats_url)
        await client.jetstream().create_object_store(IMAGES_BUCKET)
        await client.close()

    asyncio.run(create_bucket())
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url")
    images_cli.register(parser.add_subparsers())

    def fleet(*argv: str) -> str:
        args = parser.parse_args(["--nats-url", nats_url, *argv])
        assert args.func(args) == 0
        return capsys.readouterr().out

    image = tmp_path / "cat.png"
    image.write_bytes(os.urandom(MAX_CHUNK + 9))
    sha = hashlib.sha256(image.read_bytes()).hexdigest()
    assert fleet("images", "put", str(image)) == f"{sha}\n"
    assert fleet("images", "put", str(image)) == f"{sha}\n"
    fleet("images", "get", sha, "-o", str(tmp_path / "copy.png"))
    assert (tmp_path / "copy.png").read_bytes() == image.read_bytes()
    assert fleet("images", "ls").split()[:2] == [sha, str(MAX_CHUNK + 9)]


async def test_a_refused_upload_leaves_no_chunks_behind(nc: Client) -> None:
    small = await nc.jetstream().create_object_store("SMALL", max_bytes=2 * MAX_CHUNK)
    bucket = ObjectBucket(nc, "SMALL", timeout=TIMEOUT_S * 4)
    with pytest.raises(ObjectError):
        await bucket.put("too-big", os.urandom(3 * MAX_CHUNK))
    assert await stream_messages(bucket) == 0
    assert (await small.status()).size == 0


# ---- FLEET_IMAGES: what is read by name hashes to its name ---------------------------------

@pytest.fixture
async def images(nc: Client) -> ObjectStore:
    return await nc.jetstream().create_object_store(IMAGES_BUCKET)


async def test_an_image_stored_under_another_name_is_refused_not_returned(
    nc: Client, images: ObjectStore, tmp_path: Path
) -> None:
    honest = b"the honest image"
    poison = b"the poisoned bytes"
    name = hashlib.sha256(honest).hexdigest()
    await images.put(name, poison)  # raw nats-py: a name that is not its bytes' sha256
    store = ObjectBucket(nc, IMAGES_BUCKET, timeout=TIMEOUT_S * 4)
    with pytest.raises(ImageCorrupt) as refused:
        await store.get(name)
    assert refused.value.reason is ErrorReason.INPUT_CORRUPT
    assert isinstance(refused.value, ObjectCorrupt)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ImageCorrupt):
        await store.get_to_file(name, cache / "input.png")
    assert list(cache.iterdir()) == []  # nothing landed, not even a partial file


async def test_a_name_that_is_not_a_hash_is_refused_in_the_images_bucket(
    nc: Client, images: ObjectStore
) -> None:
    await images.put("not-a-hash", b"bytes")
    with pytest.raises(ImageCorrupt):
        await ObjectBucket(nc, IMAGES_BUCKET).get("not-a-hash")


async def test_an_image_named_by_its_hash_is_served(nc: Client, images: ObjectStore) -> None:
    data = os.urandom(MAX_CHUNK + 5)
    store = ObjectBucket(nc, IMAGES_BUCKET)
    name = await store.put_by_hash(data)
    assert name == hashlib.sha256(data).hexdigest()
    assert await store.get(name) == data


async def test_an_image_whose_chunks_were_replaced_is_refused(
    nc: Client, images: ObjectStore
) -> None:
    store = ObjectBucket(nc, IMAGES_BUCKET, timeout=TIMEOUT_S * 4)
    name = await store.put_by_hash(b"original bytes")
    info = await store.info(name)
    await store.js.purge_stream(store.stream, subject=store.chunk_subject(info.nuid))
    await store.js.publish(store.chunk_subject(info.nuid), b"forged bytes!!")
    with pytest.raises(ImageCorrupt):
        await store.get(name)
