"""Image generation end to end: nats-server, `fleet worker`, an mflux runner subprocess on
tiny-flux2 (random weights: the pictures are noise), and FLEET_IMAGES keyed by sha256."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from PIL import Image

from fleet.bus.objects import ObjectBucket
from fleet.models.catalog import get_card
from fleet.wire import subjects
from fleet.wire.codec import decode_event, encode
from fleet.wire.events import ErrorChunk, ErrorReason, ImageChunk, OutputEvent, TaskFinished
from fleet.wire.tasks import CancelTask, ImageEdits, ImageGeneration
from tests.integration.conftest import WarmStack, WorkerFactory, warm_stack
from tests.integration.harness import (
    REPO,
    WorkerProcess,
    client,
    events_of,
    finished,
    place_and_wait,
    run_task,
    submit,
    wait_node,
)

MODEL = "tiny-flux2"
SIDE = 128
# A final 128x128 noise PNG is ~50 kB: an event that small cannot be carrying one inline.
MAX_EVENT_BYTES = 2048
STOP_WITHIN_S = 15.0


def draw(task_id: str, **fields: object) -> ImageGeneration:
    defaults: dict[str, object] = {
        "prompt": "a lighthouse at dusk", "size": f"{SIDE}x{SIDE}", "steps": 4, "seed": 7,
    }
    return ImageGeneration(task_id=task_id, model=MODEL, **{**defaults, **fields})


def edit(task_id: str, inputs: list[str], **fields: object) -> ImageEdits:
    defaults: dict[str, object] = {
        "prompt": "the same, at night", "size": f"{SIDE}x{SIDE}", "steps": 4, "seed": 7,
        "strength": 0.5,
    }
    return ImageEdits(
        task_id=task_id, model=MODEL, input_images=inputs, **{**defaults, **fields}
    )


def png_bytes(colour: tuple[int, int, int]) -> bytes:
    """A small input picture with some structure (a bar of another colour), as PNG bytes."""
    picture = Image.new("RGB", (SIDE, SIDE), colour)
    picture.paste((255 - colour[0], 90, 160), (32, 48, 96, 80))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def images_of(events: list[OutputEvent]) -> list[ImageChunk]:
    return [e for e in events if isinstance(e, ImageChunk)]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    connection = await client(nats_url)
    yield connection
    await connection.close()


@pytest.fixture(scope="module")
def warm_images(
    tmp_path_factory: pytest.TempPathFactory, tiny_flux2_dir: Path
) -> Iterator[WarmStack]:
    """tiny-flux2 served by one worker for the tests that kill and stop nothing (see
    warm_tiny_llm); its input wait (3 s) is the longest any of them needs."""
    root = tmp_path_factory.mktemp("warm-images")
    with warm_stack(root, {MODEL: tiny_flux2_dir}, get_card(MODEL), slots=1,
                    FLEET_INPUT_WAIT_S="3") as stack:
        yield stack


@pytest.fixture
async def warm_nc(warm_images: WarmStack) -> AsyncIterator[Client]:
    connection = await client(warm_images.nats_url)
    yield connection
    await connection.close()


async def serve_images(
    nc: Client, start_worker: WorkerFactory, tiny_flux2_dir: Path, name: str = "w1", **env: str
) -> WorkerProcess:
    """A worker with tiny-flux2 placed on it and its runner ready."""
    worker = start_worker(name, models={MODEL: tiny_flux2_dir}, **env)
    node = await wait_node(nc, worker.data_dir)
    await place_and_wait(nc, get_card(MODEL), node, slots=1)
    return worker


async def raw_events_of(nc: Client, task_id: str, timeout: float = 120.0) -> list[bytes]:
    """The bytes of every event of a task in FLEET_OUT, up to and including its TaskFinished."""
    found: list[bytes] = []
    done = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        found.append(msg.data)
        if isinstance(decode_event(msg.data), TaskFinished):
            done.set()

    sub = await nc.jetstream().subscribe(
        subjects.out(task_id), stream=subjects.OUT_STREAM, ordered_consumer=True, cb=on_event
    )
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return found


async def run_to_end(nc: Client, task: ImageGeneration | ImageEdits) -> list[OutputEvent]:
    return await run_task(nc, task)


async def _set_on_image(event: asyncio.Event, msg: Msg) -> None:
    if b'"type":"image"' in msg.data:
        event.set()


async def test_a_generation_is_stored_by_hash_and_announced_without_its_bytes(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    task = draw("draw-once")
    collector = asyncio.create_task(raw_events_of(warm_nc, task.task_id))
    await submit(warm_nc, task)
    raw = await collector
    events = [decode_event(body) for body in raw]

    assert [e.type for e in events] == ["task_accepted", "image", "task_finished"]
    assert finished(events).status == "completed"
    assert all(len(body) < MAX_EVENT_BYTES and b"b64" not in body for body in raw)
    (image,) = images_of(events)
    assert (image.width, image.height, image.format) == (SIDE, SIDE, "png")
    assert image.partial_index is None and image.stats is not None and image.stats.steps == 4

    ours = await ObjectBucket(warm_nc).get(image.sha256)
    stock_store = await warm_nc.jetstream().object_store(subjects.IMAGES_BUCKET)
    stock = (await stock_store.get(image.sha256)).data
    assert ours == stock
    assert sha256_hex(ours) == image.sha256 and len(ours) == image.size_bytes
    with Image.open(io.BytesIO(ours)) as picture:
        assert picture.format == "PNG" and picture.size == (SIDE, SIDE)

    again = images_of(await run_to_end(warm_nc, draw("draw-again")))
    assert [i.sha256 for i in again] == [image.sha256]  # same seed, same bytes


async def test_partial_images_come_as_previews_then_the_final_each_stored(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    events = await run_to_end(warm_nc, draw("with-previews", partial_images=2))

    assert finished(events).status == "completed"
    assert [e.type for e in events] == ["task_accepted", "image", "image", "image", "task_finished"]
    images = images_of(events)
    assert [(i.partial_index, i.partial_total) for i in images] == [(0, 2), (1, 2), (None, None)]
    assert len({i.sha256 for i in images}) == 3
    bucket = ObjectBucket(warm_nc)
    for image in images:
        stored = await bucket.find(image.sha256)
        assert stored is not None and stored.size == image.size_bytes


async def test_a_late_joiner_fetches_the_input_from_the_store_and_completes_the_edit(
    nats_url: str, nc: Client, start_worker: WorkerFactory, tiny_flux2_dir: Path,
    tmp_path: Path,
) -> None:
    picture = tmp_path / "input.png"
    picture.write_bytes(png_bytes((200, 40, 30)))
    upload = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli", "images", "put", str(picture),
        env={**os.environ, "FLEET_NATS_URL": nats_url}, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    printed, complaint = await asyncio.wait_for(upload.communicate(), 60)
    assert upload.returncode == 0, complaint.decode()
    sha = printed.decode().strip()
    assert sha == sha256_hex(picture.read_bytes())

    task = edit("late-joiner", [sha])
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    # No worker runs yet: the task waits in the work queue for whoever serves tiny-flux2.
    assert (await nc.jetstream().stream_info(subjects.TASKS_STREAM)).state.messages == 1

    assert not (tmp_path / "late").exists()  # a brand-new data dir: nothing cached
    worker = await serve_images(nc, start_worker, tiny_flux2_dir, "late")
    events = await collector

    assert finished(events).status == "completed"
    (image,) = images_of(events)
    assert (image.width, image.height) == (SIDE, SIDE)
    assert (worker.data_dir / "images" / sha).read_bytes() == picture.read_bytes()
    assert await ObjectBucket(nc).find(image.sha256) is not None


async def test_an_input_never_uploaded_ends_input_missing_and_the_worker_keeps_serving(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    never_uploaded = sha256_hex(b"no client ever uploaded these bytes")
    events = await run_to_end(warm_nc, edit("missing-input", [never_uploaded]))

    result = finished(events)
    assert result.status == "failed" and result.reason is ErrorReason.INPUT_MISSING
    errors = [e for e in events if isinstance(e, ErrorChunk)]
    assert [e.reason for e in errors] == [ErrorReason.INPUT_MISSING]
    assert never_uploaded in errors[0].message
    assert finished(await run_to_end(warm_nc, draw("after-missing"))).status == "completed"


async def test_objects_whose_bytes_are_not_their_name_end_input_corrupt(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    worker = warm_images.worker
    # Two writers, two tampered objects: fleet's own bucket client and nats-py's stock store.
    by_fleet = sha256_hex(b"what fleet's writer claims it stored")
    await ObjectBucket(warm_nc).put(by_fleet, png_bytes((10, 120, 200)))
    by_stock = sha256_hex(b"what the stock writer claims it stored")
    stock_store = await warm_nc.jetstream().object_store(subjects.IMAGES_BUCKET)
    await stock_store.put(by_stock, png_bytes((240, 200, 10)))

    for name in (by_fleet, by_stock):
        result = finished(await run_to_end(warm_nc, edit(f"tampered-{name[:8]}", [name])))
        assert result.status == "failed" and result.reason is ErrorReason.INPUT_CORRUPT
        assert not (worker.data_dir / "images" / name).exists()  # nothing untrusted kept
    assert finished(await run_to_end(warm_nc, draw("after-corrupt"))).status == "completed"


async def test_cancel_between_steps_ends_cancelled_and_the_model_serves_on(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    # 200 steps, a preview every ~22: the cancel lands long before the last step.
    task = draw("cancel-between-steps", steps=200, partial_images=8)
    first_preview = asyncio.Event()
    await warm_nc.subscribe(subjects.out(task.task_id), cb=partial(_set_on_image, first_preview))
    collector = asyncio.create_task(events_of(warm_nc, task.task_id))
    await submit(warm_nc, task)
    await asyncio.wait_for(first_preview.wait(), 120)
    await warm_nc.publish(subjects.cancel(task.task_id), encode(CancelTask(task_id=task.task_id)))
    events = await collector

    result = finished(events)
    assert result.status == "cancelled" and result.reason is ErrorReason.CANCELLED
    previews = images_of(events)
    assert previews and all(i.partial_index is not None for i in previews)  # no final image
    assert len(previews) < task.partial_images
    assert finished(await run_to_end(warm_nc, draw("after-cancel"))).status == "completed"


async def test_an_image_the_store_refuses_fails_its_task_and_the_worker_keeps_serving(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    js = warm_nc.jetstream()
    stream = f"OBJ_{subjects.IMAGES_BUCKET}"
    config = (await js.stream_info(stream)).config
    # Full: the bucket discards new messages past max_bytes, so the upload is refused.
    await js.update_stream(replace(config, max_bytes=1024))
    try:
        # A seed of its own: bytes already in the store (another test's) need no upload.
        events = await run_to_end(warm_nc, draw("store-full", seed=4242))
    finally:  # the stack is shared: the store gets its room back whatever happened
        await js.update_stream(config)

    result = finished(events)
    assert result.status == "failed" and result.reason is ErrorReason.INTERNAL
    assert not images_of(events)  # never announce an image nobody can fetch
    assert finished(await run_to_end(warm_nc, draw("store-has-room"))).status == "completed"


async def test_a_task_cancelled_while_its_input_is_awaited_ends_once(
    warm_nc: Client, warm_images: WarmStack
) -> None:
    absent = sha256_hex(b"uploaded only after the cancel")
    waiting = edit("cancelled-while-fetching", [absent])
    collector = asyncio.create_task(events_of(warm_nc, waiting.task_id))
    await submit(warm_nc, waiting)
    await until_taken(warm_nc)
    cancel = CancelTask(task_id=waiting.task_id)
    await warm_nc.publish(subjects.cancel(waiting.task_id), encode(cancel))
    assert finished(await collector).status == "cancelled"

    # The same worker fetches this one after the first fetch began, so its bounded wait ends
    # later: once it has failed, whatever the first fetch's end caused is published too.
    follower = edit("fetched-after-the-cancel", [absent])
    assert finished(await run_to_end(warm_nc, follower)).reason is ErrorReason.INPUT_MISSING
    out = subjects.out(waiting.task_id)
    stored = await warm_nc.jetstream().stream_info(subjects.OUT_STREAM, subjects_filter=out)
    assert stored.state.subjects == {out: 1}  # the cancel's task_finished, nothing after it


async def until_taken(nc: Client, timeout: float = 30.0) -> None:
    """A worker has pulled tiny-flux2's next task and holds it unacknowledged."""
    js = nc.jetstream()
    async with asyncio.timeout(timeout):
        while not await _held_by_a_worker(js):
            await asyncio.sleep(0.05)  # polling the consumer's state, bounded by the timeout


async def _held_by_a_worker(js: JetStreamContext) -> bool:
    try:
        info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable(MODEL))
    except NotFoundError:  # the worker makes the consumer on its first pull
        return False
    return info.num_ack_pending > 0


async def test_a_stopped_worker_shuts_its_runner_down_and_exits_promptly(
    nc: Client, start_worker: WorkerFactory, tiny_flux2_dir: Path
) -> None:
    worker = await serve_images(nc, start_worker, tiny_flux2_dir)
    assert finished(await run_to_end(nc, draw("before-stop"))).status == "completed"
    assert worker.process is not None
    worker.process.send_signal(signal.SIGTERM)
    # Well inside nats-py's 30 s drain timeout, which an unread pull answer would run out.
    assert await asyncio.to_thread(worker.process.wait, STOP_WITHIN_S) == 0
    (runner_log,) = (worker.data_dir / "logs").glob("run-*.log")
    assert "exiting with 0 (shutdown)" in runner_log.read_text()
