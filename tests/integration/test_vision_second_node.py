"""The fleet-wide vision cache across real processes: nats-server and two `fleet worker`s with
tiny-vlm. The image is stored before the second node exists; the first node's runner encodes
it once (a second task there is a node-local hit); then the second node takes the model over,
fetches the stored image before dispatch (a late joiner) and the first node's features from
FLEET_VISION: its task is a hit without an encode of its own, with the same greedy answer."""

from __future__ import annotations

import io
import time
from pathlib import Path

from nats.aio.client import Client
from PIL import Image

from bench.fleet_stack import wait_runner_ready
from fleet.bus.objects import ObjectBucket
from fleet.models.catalog import get_card
from fleet.placement import find_instance, place, remove
from fleet.wire.tasks import ChatMessage, ImagePart, TextGeneration, TextPart
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import finished, run_task, text_of, wait_node

MODEL = "tiny-vlm"


def chat(task_id: str, sha: str) -> TextGeneration:
    return TextGeneration(task_id=task_id, model=MODEL, temperature=0.0, max_tokens=6,
                          messages=[ChatMessage(role="user", content=[
                              ImagePart(sha256=sha), TextPart(text="What is in this picture?")])])


async def test_a_second_node_hits_the_first_nodes_encode_through_the_store(
    provisioned_nc: Client, start_worker: WorkerFactory, tiny_vlm_dir: Path
) -> None:
    nc = provisioned_nc
    png = io.BytesIO()
    Image.new("RGB", (48, 36), (20, 160, 60)).save(png, format="PNG")
    sha = await ObjectBucket(nc).put_by_hash(png.getvalue())
    card = get_card(MODEL)

    first = start_worker("first", models={MODEL: tiny_vlm_dir})
    first_node = await wait_node(nc, first.data_dir)
    await place(nc.jetstream(), card, node_id=first_node, slots=2)
    await wait_runner_ready(nc, MODEL, time.monotonic() + 120, node_id=first_node)
    encoded = await run_task(nc, chat("first-encode", sha))
    again = await run_task(nc, chat("first-again", sha))
    usages = [finished(events).usage for events in (encoded, again)]
    assert [(u.images, u.cached_images) for u in usages if u] == [(1, 0), (1, 1)]

    second = start_worker("second", models={MODEL: tiny_vlm_dir})
    second_node = await wait_node(nc, second.data_dir)
    instance = await find_instance(nc.jetstream(), MODEL)
    assert instance is not None
    await remove(nc.jetstream(), instance.instance_id)
    await place(nc.jetstream(), card, node_id=second_node, slots=2)
    await wait_runner_ready(nc, MODEL, time.monotonic() + 120, node_id=second_node)
    elsewhere = await run_task(nc, chat("second-node", sha))
    end = finished(elsewhere)
    assert end.status == "completed" and end.node_id == second_node
    assert end.usage is not None and (end.usage.images, end.usage.cached_images) == (1, 1)
    # The store's features give the same answer (text: the runner coalesces tokens per chunk).
    assert text_of(elsewhere) == text_of(encoded) == text_of(again) != ""
    features = second.data_dir / "vision-features"
    assert any(features.glob("*/*.safetensors"))  # placed there by the worker, from the store
