"""Provisioning from ops/jetstream against a real nats-server: idempotent, never clobbering.

Every check of the result goes through nats-py's own JetStream API, not through Fleet.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError

from fleet.bus.connect import connect
from fleet.bus.embedded import ops_dir, server_binary
from fleet.bus.provision import definitions, ensure_task_consumer, provision
from fleet.errors import NatsUnavailable, ProvisioningConflict
from fleet.wire import subjects

SECOND = 1_000_000_000  # ops/jetstream durations are nanoseconds


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-provision")
    yield client
    await client.close()


def ops_copy(tmp_path: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """A copy of ops/jetstream with some keys of some files changed (file stem -> keys)."""
    copy = tmp_path / "jetstream"
    shutil.copytree(ops_dir() / "jetstream", copy)
    for stem, keys in changes.items():
        path = copy / f"{stem}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
    return copy


# ---- idempotence ---------------------------------------------------------------------------

async def test_first_provisioning_creates_every_definition(nc: Client) -> None:
    outcomes = await provision(nc)
    assert {o.name for o in outcomes} == {d["name"] for d in definitions()}
    assert {o.action for o in outcomes} == {"created"}


async def test_provisioning_twice_is_a_no_op(nc: Client) -> None:
    await provision(nc)
    js = nc.jetstream()
    before = {o.name: (await js.stream_info(o.name)).config for o in await provision(nc)}
    again = await provision(nc)
    assert [o.action for o in again] == ["unchanged"] * len(again)
    after = {o.name: (await js.stream_info(o.name)).config for o in again}
    assert after == before


async def test_streams_get_the_config_that_ops_jetstream_declares(nc: Client) -> None:
    await provision(nc)
    js = nc.jetstream()
    tasks = await js.stream_info(subjects.TASKS_STREAM)
    assert tasks.config.retention == "workqueue"
    assert tasks.config.discard == "new"
    assert tasks.config.subjects == [subjects.TASKS_ALL]
    out = await js.stream_info(subjects.OUT_STREAM)
    assert out.config.retention == "limits"
    assert out.config.max_age == 3600.0


# ---- conflicts -----------------------------------------------------------------------------

async def test_conflicting_stream_is_reported_with_the_key_and_not_clobbered(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(name="FLEET_OUT", subjects=["fleet.out.>"], max_age=60.0)
    await js.publish("fleet.out.kept-1", b"still here")

    with pytest.raises(ProvisioningConflict) as caught:
        await provision(nc)

    assert "FLEET_OUT" in caught.value.message
    assert "max_age" in caught.value.message
    info = await js.stream_info("FLEET_OUT")
    assert info.config.max_age == 60.0
    assert info.state.messages == 1
    assert (await js.get_last_msg("FLEET_OUT", "fleet.out.kept-1")).data == b"still here"


async def test_a_changed_definition_conflicts_with_what_an_earlier_run_created(
    nc: Client, tmp_path: Path
) -> None:
    await provision(nc)
    changed = ops_copy(tmp_path, {"FLEET_TASKS": {"max_msgs_per_subject": 5}})
    with pytest.raises(ProvisioningConflict, match=r"FLEET_TASKS.*max_msgs_per_subject"):
        await provision(nc, changed)
    info = await nc.jetstream().stream_info(subjects.TASKS_STREAM)
    assert info.config.max_msgs_per_subject == 1000


async def test_a_changed_description_alone_is_not_a_conflict(
    nc: Client, tmp_path: Path
) -> None:
    await provision(nc)
    reworded = ops_copy(tmp_path, {"FLEET_EVENTS": {"description": "reworded prose"}})
    outcomes = await provision(nc, reworded)
    assert {o.action for o in outcomes} == {"unchanged"}


# ---- buckets and object store through nats-py --------------------------------------------

@pytest.mark.parametrize(
    "bucket",
    [
        subjects.NODES_BUCKET,
        subjects.INSTANCES_BUCKET,
        subjects.RUNNERS_BUCKET,
        subjects.CANCELS_BUCKET,
    ],
)
async def test_kv_bucket_works_through_nats_py(nc: Client, bucket: str) -> None:
    await provision(nc)
    kv = await nc.jetstream().key_value(bucket)
    revision = await kv.put("key-1", b"value-1")
    entry = await kv.get("key-1")
    assert (entry.value, entry.revision) == (b"value-1", revision)
    await kv.delete("key-1")
    with pytest.raises(KeyNotFoundError):
        await kv.get("key-1")


async def test_instances_bucket_supports_compare_and_set(nc: Client) -> None:
    await provision(nc)
    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    first = await kv.create("inst-1", b"node-a")
    with pytest.raises(KeyWrongLastSequenceError):
        await kv.create("inst-1", b"node-b")
    await kv.update("inst-1", b"node-c", last=first)
    with pytest.raises(KeyWrongLastSequenceError):
        await kv.update("inst-1", b"node-d", last=first)
    assert (await kv.get("inst-1")).value == b"node-c"


async def test_image_object_store_works_through_nats_py(nc: Client) -> None:
    await provision(nc)
    store = await nc.jetstream().object_store(subjects.IMAGES_BUCKET)
    data = bytes(range(256)) * 1200  # ~300 KB: several chunks
    name = "ab" * 32
    info = await store.put(name, data)
    assert info.size == len(data)
    assert (await store.get(name)).data == data


async def test_node_key_left_to_expire_gives_watchers_a_limit_marker(
    nc: Client, tmp_path: Path
) -> None:
    short = {"max_age": 1 * SECOND, "duplicate_window": 1 * SECOND}
    await provision(nc, ops_copy(tmp_path, {"KV_FLEET_NODES": short}))
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    watcher = await kv.watch("node-a1")
    assert await watcher.updates(timeout=5) is None  # nothing there yet

    await kv.put("node-a1", b"heartbeat")
    put = await watcher.updates(timeout=5)
    assert (put.key, put.value, put.operation) == ("node-a1", b"heartbeat", None)

    gone = await watcher.updates(timeout=15)  # max age 1 s, then the server's marker
    assert (gone.key, gone.operation) == ("node-a1", "PURGE")
    await watcher.stop()


# ---- the task consumer and the work queue -------------------------------------------------

async def test_ensure_task_consumer_is_idempotent(nc: Client) -> None:
    await provision(nc)
    first = await ensure_task_consumer(nc, "tiny-llm", max_deliver=4, ack_wait_s=12.5)
    second = await ensure_task_consumer(nc, "tiny-llm", max_deliver=4, ack_wait_s=12.5)
    assert (first.action, second.action) == ("created", "unchanged")
    assert first.name == subjects.durable("tiny-llm")
    info = await nc.jetstream().consumer_info(subjects.TASKS_STREAM, first.name)
    assert info.config.filter_subject == subjects.tasks("tiny-llm")
    assert info.config.max_deliver == 4
    assert info.config.ack_wait == 12.5


async def test_task_consumer_with_other_settings_is_reported_not_clobbered(
    nc: Client,
) -> None:
    await provision(nc)
    await ensure_task_consumer(nc, "tiny-llm", max_deliver=3)
    with pytest.raises(ProvisioningConflict, match="max_deliver"):
        await ensure_task_consumer(nc, "tiny-llm", max_deliver=9)
    info = await nc.jetstream().consumer_info(subjects.TASKS_STREAM, "tasks-tiny-llm")
    assert info.config.max_deliver == 3


async def test_each_model_gets_its_own_consumer(nc: Client) -> None:
    await provision(nc)
    await ensure_task_consumer(nc, "tiny-llm")
    await ensure_task_consumer(nc, "smollm2-135m")
    js = nc.jetstream()
    await js.publish(subjects.tasks("tiny-llm"), b"for tiny")
    await js.publish(subjects.tasks("smollm2-135m"), b"for smol")
    got = {}
    for model in ("smollm2-135m", "tiny-llm"):
        sub = await js.pull_subscribe_bind(subjects.durable(model), stream=subjects.TASKS_STREAM)
        [msg] = await sub.fetch(1, timeout=10)
        await msg.ack()
        got[model] = (msg.subject, msg.data)
    assert got == {
        "tiny-llm": ("fleet.tasks.tiny-llm", b"for tiny"),
        "smollm2-135m": ("fleet.tasks.smollm2-135m", b"for smol"),
    }


async def test_full_task_queue_rejects_new_tasks_per_subject(
    nc: Client, tmp_path: Path
) -> None:
    await provision(nc, ops_copy(tmp_path, {"FLEET_TASKS": {"max_msgs_per_subject": 2}}))
    js = nc.jetstream()
    full = subjects.tasks("tiny-llm")
    await js.publish(full, b"task-1")
    await js.publish(full, b"task-2")

    with pytest.raises(APIError) as caught:
        await asyncio.wait_for(js.publish(full, b"task-3"), 10)
    assert "maximum messages per subject" in str(caught.value.description)

    await js.publish(subjects.tasks("smollm2-135m"), b"other model still queues")
    info = await js.stream_info(subjects.TASKS_STREAM)
    assert info.state.messages == 3
    assert (await js.get_last_msg(subjects.TASKS_STREAM, full)).data == b"task-2"


# ---- a server without JetStream -------------------------------------------------------------

@pytest.fixture
def core_only_url() -> Iterator[str]:
    """A plain nats-server (no config, no JetStream) on a free port."""
    process = subprocess.Popen(
        [str(server_binary()), "-a", "127.0.0.1", "-p", "-1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stderr
        for line in process.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while not (found := re.search(r"client connections on \S*:(\d+)", lines.get(timeout=20))):
            pass
        yield f"nats://127.0.0.1:{found.group(1)}"
    finally:
        process.terminate()
        process.wait(10)


async def test_provisioning_without_jetstream_is_a_clear_error(core_only_url: str) -> None:
    client = await connect(core_only_url, "test-no-js")
    try:
        with pytest.raises(NatsUnavailable, match="JetStream is not enabled"):
            await provision(client)
    finally:
        await client.close()
