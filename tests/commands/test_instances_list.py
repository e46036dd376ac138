"""`fleet instances list` shows each instance's runners, a download with its progress bar;
`fleet instances place` finds a model named only in FLEET_MODELS. Real nats-server."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.weights import FleetModels
from fleet.commands.stack import card_of, instances_cmd
from fleet.config import load_settings
from fleet.errors import FleetError, PlacementError
from fleet.models.catalog import describe_model_dir
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo, RunnerRecord, ShardAssignment
from fleet.wire.codec import encode
from fleet.wire.runners import RunnerConnecting, RunnerDownloading


async def test_list_shows_a_download_in_progress(
    provisioned_nc: Client, nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = provisioned_nc.jetstream()
    shard = ShardAssignment(node_id="n1", runner_id="pending")
    instance = Instance(instance_id="i-big", model="big", shards=[shard], created_at=1)
    await (await js.key_value(subjects.INSTANCES_BUCKET)).put("i-big", encode(instance))
    record = RunnerRecord(
        runner_id="fetch-i-big", instance_id="i-big", node_id="n1", model="big",
        status=RunnerDownloading(bytes_done=270_000_000, bytes_total=540_000_000), at=1,
    )
    await (await js.key_value(subjects.RUNNERS_BUCKET)).put(record.runner_id, encode(record))
    settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path}, env={})
    assert await instances_cmd(settings, argparse.Namespace(action="list")) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == ["i-big", "big"]
    assert line.endswith("downloading [##########----------]  50% 270/540 MB")


async def test_a_card_is_found_in_the_fleet_catalogue(
    provisioned_nc: Client, nats_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    await FleetModels(provisioned_nc).publish(describe_model_dir("only-there", folder), folder)
    settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path / "empty"}, env={})
    card = await card_of(provisioned_nc, "only-there", settings)
    assert card.id == "only-there" and card.manifest is not None
    assert (await card_of(provisioned_nc, "tiny-llm", settings)).id == "tiny-llm"  # built-in


async def test_place_shards_then_list_each_shard(
    provisioned_nc: Client, nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = provisioned_nc.jetstream()
    nodes = await js.key_value(subjects.NODES_BUCKET)
    for name, free in (("n1", 500), ("n2", 300)):  # MB; each rank also holds 113 MB
        info = NodeInfo(
            node_id=name, hostname=name, memory_total_bytes=10**12,
            memory_available_bytes=free * 10**6, cpu_count=2, started_at=0, at=time.time(),
            models_available=["smollm2-135m"], ring_address=f"127.0.0.1:{free}",
        )
        await nodes.put(name, encode(info))
    settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path}, env={})
    place = argparse.Namespace(action="place", model="smollm2-135m", node=None, slots=2,
                               replicas=1, shards=2)
    assert await instances_cmd(settings, place) == 0
    placed = capsys.readouterr().out
    assert "n1 (rank 0, layers 0-20), n2 (rank 1, layers 20-30)" in placed
    instance_id = placed.split()[1]
    record = RunnerRecord(
        runner_id="r2", instance_id=instance_id, node_id="n2", model="smollm2-135m",
        status=RunnerConnecting(), rank=1, at=1,
    )
    await (await js.key_value(subjects.RUNNERS_BUCKET)).put("r2", encode(record))
    assert await instances_cmd(settings, argparse.Namespace(action="list")) == 0
    head, rank0, rank1 = capsys.readouterr().out.splitlines()
    assert head.split()[:2] == [instance_id, "smollm2-135m"] and "shards=2" in head
    assert rank0.split() == ["rank", "0", "n1", "layers", "0-20", "pending"]
    assert rank1.split() == ["rank", "1", "n2", "layers", "20-30", "connecting"]
    # Both nodes are in a group now: a second sharded instance has nowhere to go.
    with pytest.raises(PlacementError, match="need 2 live nodes"):
        await instances_cmd(settings, place)


async def test_removing_an_instance_that_is_not_placed_says_so(
    provisioned_nc: Client, nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = provisioned_nc.jetstream()
    shard = ShardAssignment(node_id="n1", runner_id="pending")
    instance = Instance(instance_id="i-here", model="m", shards=[shard], created_at=1)
    await (await js.key_value(subjects.INSTANCES_BUCKET)).put("i-here", encode(instance))
    settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path}, env={})
    remove = argparse.Namespace(action="remove", instance_id="i-here")
    assert await instances_cmd(settings, remove) == 0
    assert capsys.readouterr().out == "removed i-here\n"
    with pytest.raises(FleetError, match="no instance i-here is placed"):
        await instances_cmd(settings, remove)  # gone now: not "removed" a second time
