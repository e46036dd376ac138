"""Image endpoints against a real nats-server and object store, with a stand-in image worker."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io

import httpx
import orjson
import pytest
from gateway_helpers import StandInWorker, sse_blocks, vision_card
from nats.aio.client import Client
from PIL import Image

from fleet.bus.objects import ObjectBucket
from fleet.config import Settings
from fleet.wire.events import ImageChunk, OutputEvent, TaskAccepted, TaskFinished
from fleet.wire.tasks import ImageEdits, ImageGeneration, Task, TextGeneration


def png(color: str, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def webp(color: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buffer, format="WEBP")
    return buffer.getvalue()


@pytest.fixture
def image_worker(nc: Client) -> StandInWorker:
    return StandInWorker(nc, "tiny-flux2")


async def stored(nc: Client, *images: bytes) -> list[str]:
    bucket = ObjectBucket(nc)
    return [await bucket.put_by_hash(data) for data in images]


def image_script(final: str, previews: list[str]):
    def script(task: Task) -> list[OutputEvent]:
        common = {"task_id": task.task_id, "at": 2.0, "format": "png", "width": 8, "height": 8}
        events: list[OutputEvent] = [
            TaskAccepted(task_id=task.task_id, at=1.0, model=task.model, node_id="n", runner_id="r")
        ]
        for index, sha in enumerate(previews):
            events.append(
                ImageChunk(
                    **common,
                    sha256=sha,
                    image_index=0,
                    partial_index=index,
                    partial_total=len(previews),
                    size_bytes=1,
                )
            )
        events.append(ImageChunk(**common, sha256=final, image_index=0, size_bytes=1))
        events.append(TaskFinished(task_id=task.task_id, at=3.0, status="completed"))
        return events

    return script


async def test_generation_answers_b64_json_or_a_url_that_serves_the_image(
    client: httpx.AsyncClient, nc: Client, image_worker: StandInWorker
) -> None:
    image = png("red")
    [sha] = await stored(nc, image)
    body = {"model": "tiny-flux2", "prompt": "a red square", "size": "128x128", "seed": 7}
    response, task = await asyncio.gather(
        client.post("/v1/images/generations", json=body),
        image_worker.answer(image_script(sha, [])),
    )
    assert response.status_code == 200, response.text
    assert base64.b64decode(response.json()["data"][0]["b64_json"]) == image
    assert isinstance(task, ImageGeneration)
    assert response.headers["x-fleet-task-id"] == task.task_id
    assert (task.width, task.seed, task.partial_images) == (128, 7, 0)

    response, _ = await asyncio.gather(
        client.post("/v1/images/generations", json={**body, "response_format": "url"}),
        image_worker.answer(image_script(sha, [])),
    )
    url = response.json()["data"][0]["url"]
    assert url == f"http://gateway/v1/images/{sha}"
    served = await client.get(url)
    assert served.content == image
    assert served.headers["content-type"] == "image/png"


async def test_a_streamed_generation_sends_partial_images_then_the_final(
    client: httpx.AsyncClient, nc: Client, image_worker: StandInWorker
) -> None:
    final, first, second = await stored(nc, png("red"), png("gray"), png("pink"))
    body = {"model": "tiny-flux2", "prompt": "a red square", "stream": True, "partial_images": 2}
    response, task = await asyncio.gather(
        client.post("/v1/images/generations", json=body),
        image_worker.answer(image_script(final, [first, second])),
    )
    assert isinstance(task, ImageGeneration) and task.partial_images == 2
    blocks = sse_blocks(response.text)
    assert [block["event"] for block in blocks] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert [block["id"] for block in blocks] == ["2", "3", "4"]  # after task_accepted
    datas = [orjson.loads(block["data"]) for block in blocks]
    assert [d.get("partial_image_index") for d in datas] == [0, 1, None]
    assert datas[-1]["type"] == "image_generation.completed"
    assert hashlib.sha256(base64.b64decode(datas[-1]["b64_json"])).hexdigest() == final


async def test_edits_upload_their_images_by_hash_before_publishing(
    client: httpx.AsyncClient, nc: Client, image_worker: StandInWorker
) -> None:
    upload = webp("blue")
    [result] = await stored(nc, png("green"))
    files = [("image[]", ("in.webp", upload, "image/webp"))]
    data = {"model": "tiny-flux2", "prompt": "make it green", "strength": "0.4", "n": "1"}
    response, task = await asyncio.gather(
        client.post("/v1/images/edits", files=files, data=data),
        image_worker.answer(image_script(result, [])),
    )
    assert response.status_code == 200, response.text
    assert isinstance(task, ImageEdits)
    assert task.input_images == [hashlib.sha256(upload).hexdigest()]
    assert task.strength == 0.4
    served = await client.get(f"/v1/images/{task.input_images[0]}")
    assert served.content == upload
    assert served.headers["cache-control"] == "public, max-age=31536000, immutable"  # no keys


@pytest.mark.parametrize(
    ("files", "data"),
    [
        ([], {"model": "tiny-flux2", "prompt": "x"}),
        (
            [("image", ("a.txt", b"not an image", "text/plain"))],
            {"model": "tiny-flux2", "prompt": "x"},
        ),
        ([("image", ("a.png", png("red"), "image/png"))], {"model": "tiny-flux2", "prompt": ""}),
        (
            [
                ("image", ("a.png", png("red"), "image/png")),
                ("mask", ("m.png", png("red"), "image/png")),
            ],
            {"model": "tiny-flux2", "prompt": "x"},
        ),
        (
            [("image", ("a.png", png("red"), "image/png"))],
            {"model": "tiny-flux2", "prompt": "x", "n": "many"},
        ),
    ],
)
async def test_bad_edit_forms_are_400(client: httpx.AsyncClient, files: list, data: dict) -> None:
    response = await client.post("/v1/images/edits", files=files or None, data=data)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_a_broken_multipart_body_is_400(client: httpx.AsyncClient) -> None:
    headers = {"content-type": "multipart/form-data; boundary=xyz"}
    response = await client.post("/v1/images/edits", content=b"--xyz\r\ngarbage", headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"]


async def test_chat_images_are_stored_once_and_travel_by_hash(
    client: httpx.AsyncClient, nc: Client, settings: Settings
) -> None:
    vision_card(settings.data_dir)
    image = png("orange")
    sha = hashlib.sha256(image).hexdigest()
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    parts = [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": {"url": f"http://elsewhere/v1/images/{sha}"}},
    ]
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": parts}]}
    worker = StandInWorker(nc, "tiny-vlm")
    _, task = await asyncio.gather(
        client.post("/v1/chat/completions", json=body),
        worker.answer(lambda t: [TaskFinished(task_id=t.task_id, at=1, status="completed")]),
    )
    assert isinstance(task, TextGeneration)
    assert task.image_hashes() == [sha, sha]
    assert (await ObjectBucket(nc).info(sha)).size == len(image)


async def test_an_image_task_resumes_as_image_events(
    client: httpx.AsyncClient, nc: Client, image_worker: StandInWorker
) -> None:
    final, preview = await stored(nc, png("red"), png("gray"))
    body = {"model": "tiny-flux2", "prompt": "a red square", "partial_images": 1}
    response, task = await asyncio.gather(
        client.post("/v1/images/generations", json=body),
        image_worker.answer(image_script(final, [preview])),
    )
    assert response.status_code == 200, response.text
    resumed = await client.get(f"/v1/tasks/{task.task_id}/events")
    blocks = sse_blocks(resumed.text)
    assert [b["event"] for b in blocks] == [
        "image_generation.partial_image", "image_generation.completed"]
    assert base64.b64decode(orjson.loads(blocks[-1]["data"])["b64_json"]) == png("red")
    # The client saw the preview (accepted is event 1, the preview 2): only the final again.
    rest = sse_blocks((await client.get(f"/v1/tasks/{task.task_id}/events?after=2")).text)
    assert [b["event"] for b in rest] == ["image_generation.completed"]
