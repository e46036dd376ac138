"""The worker's image cache: LRU by bytes, pins, and fetching inputs from a real object store."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.objects import MAX_CHUNK, ROLLUP, ObjectBucket
from fleet.errors import InputCorrupt, InputMissing, ObjectCorrupt
from fleet.wire.events import ErrorReason
from fleet.wire.subjects import IMAGES_BUCKET
from fleet.worker.inputs import ImageCache

HANG_GUARD_S = 20.0


def blob(tag: int, size: int = 100) -> bytes:
    return bytes([tag]) * size


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(cache: ImageCache, data: bytes) -> str:
    """What a runner does (write the file under its hash), then the worker's adopt."""
    cache.path(sha(data)).write_bytes(data)
    cache.adopt(sha(data))
    return sha(data)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
async def store(nc: Client) -> ObjectBucket:
    await nc.jetstream().create_object_store(IMAGES_BUCKET)
    return ObjectBucket(nc, IMAGES_BUCKET, timeout=2.0)


@pytest.fixture
def cache(tmp_path: Path) -> ImageCache:
    return ImageCache(tmp_path / "images", max_bytes=250)


def test_least_recently_used_goes_first_when_over_budget(cache: ImageCache) -> None:
    first, second = put(cache, blob(1)), put(cache, blob(2))
    put(cache, blob(1))  # used again: now the most recent
    third = put(cache, blob(3))
    assert (first in cache, second in cache, third in cache) == (True, False, True)
    assert not cache.path(second).exists()
    assert cache.total_bytes == 200


def test_pinned_files_survive_eviction_until_released(cache: ImageCache) -> None:
    pinned = put(cache, blob(1))
    cache.pin([pinned])
    unpinned = put(cache, blob(2))
    put(cache, blob(3))
    assert pinned in cache and unpinned not in cache
    put(cache, blob(4, size=200))  # over budget while the pin holds
    assert pinned in cache and cache.total_bytes == 300
    cache.release([pinned])
    assert pinned not in cache and cache.total_bytes <= 250


def test_a_restart_adopts_files_and_drops_unfinished_downloads(tmp_path: Path) -> None:
    first = ImageCache(tmp_path, max_bytes=1000)
    kept = put(first, blob(1))
    (tmp_path / f".{'0' * 64}.x.part").write_bytes(b"half")
    again = ImageCache(tmp_path, max_bytes=1000)
    assert kept in again and again.total_bytes == 100
    assert sorted(os.listdir(tmp_path)) == [kept]


def test_a_restart_drops_a_killed_runners_half_written_output(tmp_path: Path) -> None:
    (tmp_path / f".{'1' * 64}.k3j2.tmp").write_bytes(b"half an image")
    assert os.listdir(ImageCache(tmp_path, max_bytes=1000).directory) == []


async def test_a_misnamed_runner_output_is_refused_by_its_upload_and_discarded(
    cache: ImageCache, store: ObjectBucket
) -> None:
    output = blob(7)
    assert cache.adopt(put(cache, output)) == cache.path(sha(output))
    assert await store.put_by_hash(cache.path(sha(output)), sha256=sha(output)) == sha(output)
    wrong = sha(blob(8))
    cache.path(wrong).write_bytes(blob(9))
    cache.adopt(wrong)
    with pytest.raises(ObjectCorrupt, match="do not hash to the name"):
        await store.put_by_hash(cache.path(wrong), sha256=wrong)
    cache.discard(wrong)
    assert wrong not in cache and not cache.path(wrong).exists()
    assert await store.find(wrong) is None


async def test_ensure_fetches_then_hits_without_nats(
    cache: ImageCache, store: ObjectBucket, nc: Client
) -> None:
    data = blob(5, size=120)
    image = await store.put_by_hash(data)
    paths = await cache.ensure([image], store, wait_s=1.0)
    assert paths[image].read_bytes() == data
    cache.release([image])
    await nc.flush()
    sent_before = nc.stats["out_msgs"]
    again = await cache.ensure([image], store, wait_s=1.0)
    await nc.flush()
    assert again == paths
    assert nc.stats["out_msgs"] == sent_before


async def test_ensure_pins_what_it_returns(cache: ImageCache, store: ObjectBucket) -> None:
    image = await store.put_by_hash(blob(5, size=200))
    await cache.ensure([image], store, wait_s=1.0)
    put(cache, blob(6))
    assert image in cache
    cache.release([image])
    assert image not in cache


async def test_an_input_uploaded_during_the_wait_is_fetched(
    cache: ImageCache, store: ObjectBucket
) -> None:
    data = blob(11)
    waiting = asyncio.create_task(cache.ensure([sha(data)], store, wait_s=HANG_GUARD_S))
    await store.put_by_hash(data)
    paths = await asyncio.wait_for(waiting, HANG_GUARD_S)
    assert paths[sha(data)].read_bytes() == data


async def test_an_input_that_never_arrives_is_missing_after_the_wait(
    cache: ImageCache, store: ObjectBucket
) -> None:
    absent = sha(b"never uploaded")
    started = time.monotonic()
    with pytest.raises(InputMissing) as caught:
        await asyncio.wait_for(cache.ensure([absent], store, wait_s=0.3), HANG_GUARD_S)
    assert 0.3 <= time.monotonic() - started < 3.0
    assert (caught.value.reason, caught.value.sha) == (ErrorReason.INPUT_MISSING, absent)
    assert absent not in cache


async def test_bytes_that_fail_their_digest_are_corrupt(
    cache: ImageCache, store: ObjectBucket
) -> None:
    image = await store.put_by_hash(blob(12, size=MAX_CHUNK + 1))
    other = base64.urlsafe_b64encode(hashlib.sha256(b"other").digest()).decode()
    doctored = dataclasses.replace(await store.info(image), digest="SHA-256=" + other)
    await store.js.publish(
        store.meta_subject(image), doctored.to_json(store.bucket, MAX_CHUNK), headers=ROLLUP
    )
    with pytest.raises(InputCorrupt) as caught:
        await cache.ensure([image], store, wait_s=1.0)
    assert caught.value.reason is ErrorReason.INPUT_CORRUPT
    assert image not in cache and not cache.path(image).exists()


async def test_an_object_named_for_other_bytes_is_corrupt(
    cache: ImageCache, store: ObjectBucket
) -> None:
    claimed = sha(blob(13))
    await store.put(claimed, blob(14))
    with pytest.raises(InputCorrupt):
        await cache.ensure([claimed], store, wait_s=1.0)
    assert claimed not in cache and not cache.path(claimed).exists()


async def test_a_file_removed_behind_the_cache_is_fetched_again(
    cache: ImageCache, store: ObjectBucket
) -> None:
    data = blob(15)
    image = await store.put_by_hash(data)
    put(cache, data)
    cache.path(image).unlink()
    paths = await cache.ensure([image], store, wait_s=1.0)
    assert paths[image].read_bytes() == data and cache.total_bytes == len(data)
