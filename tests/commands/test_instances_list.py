"""`fleet instances list` shows each instance's runners, a download with its progress bar;
`fleet instances place` finds a model named only in FLEET_MODELS. Real nats-server."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.weights import FleetModels
from fleet.commands.stack import card_of, instances_cmd
from fleet.config import load_settings
from fleet.models.catalog import describe_model_dir
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord, ShardAssignment
from fleet.wire.codec import encode
from fleet.wire.runners import RunnerDownloading


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
