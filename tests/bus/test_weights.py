"""Model weights on the bus (fleet.bus.weights) against a real nats-server and real files:
publish, fetch verified, dedup across models, remove keeping shared files, resume."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nats.aio.client import Client

from fleet.bus.weights import FETCH_PREFIX, FleetModels, build_manifest, fetch_in_progress
from fleet.errors import ObjectCorrupt
from fleet.models.catalog import builtin_cards, describe_model_dir
from fleet.wire.cluster import ModelCard


def _model_dir(root: Path, name: str, shard: bytes, tokenizer: bytes = b"tok") -> Path:
    folder = root / name
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(shard)
    (folder / "sub" / "tokenizer.json").write_bytes(tokenizer)
    (folder / ".lock-ignored").write_text("not part of the model")
    return folder


def _card(model_id: str, folder: Path) -> ModelCard:
    return describe_model_dir(model_id, folder)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file()
                   and not p.name.startswith("."))
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()


async def test_manifest_lists_files_with_hashes_and_architecture(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path, "m", b"w" * 10)
    manifest = build_manifest(folder)
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors",
                                                "sub/tokenizer.json"]
    assert manifest.total_bytes == sum(f.size for f in manifest.files)
    assert manifest.architecture == "Qwen2ForCausalLM"
    assert build_manifest(folder).revision == manifest.revision


async def test_publish_then_fetch_into_an_empty_dir(
    provisioned_nc: Client, tmp_path: Path
) -> None:
    fleet = FleetModels(provisioned_nc)
    folder = _model_dir(tmp_path / "a", "m", os.urandom(3 * 1024 * 1024 + 17))
    published = await fleet.publish(_card("m", folder), folder)
    assert published.manifest is not None and len(published.manifest.files) == 3
    # Another node reads the card from the fleet, not from its own files.
    card = await fleet.get("m")
    assert card == published
    seen: list[tuple[int, int]] = []
    models = tmp_path / "b" / "models"
    path = await fleet.fetch(card, models, lambda done, total: seen.append((done, total)))
    assert path == models / "m"
    _same_files(folder, path)
    assert seen[-1] == (card.manifest.total_bytes, card.manifest.total_bytes)
    assert fetch_in_progress(models) == []


async def test_equal_files_are_stored_once_and_remove_keeps_shared_ones(
    provisioned_nc: Client, tmp_path: Path
) -> None:
    fleet = FleetModels(provisioned_nc)
    one = _model_dir(tmp_path, "one", b"shard one", tokenizer=b"shared tokenizer")
    two = _model_dir(tmp_path, "two", b"shard two", tokenizer=b"shared tokenizer")
    await fleet.publish(_card("one", one), one)
    await fleet.publish(_card("two", two), two)
    # config.json and the tokenizer are equal in both: 2 shared + 2 shards.
    assert len(await fleet.stored_names()) == 4
    gone = await fleet.remove("one")
    assert len(gone) == 1  # only its own shard
    assert await fleet.get("one") is None
    card = await fleet.get("two")
    assert card is not None and card.manifest is not None
    assert {f.sha256 for f in card.manifest.files} == await fleet.stored_names()
    fetched = await fleet.fetch(card, tmp_path / "elsewhere")
    _same_files(two, fetched)


async def test_an_interrupted_fetch_resumes_without_refetching_finished_files(
    provisioned_nc: Client, tmp_path: Path
) -> None:
    fleet = FleetModels(provisioned_nc)
    folder = _model_dir(tmp_path, "m", os.urandom(2 * 1024 * 1024))
    card = await fleet.publish(_card("m", folder), folder)
    assert card.manifest is not None
    models = tmp_path / "node" / "models"
    # What a fetch killed after its first file leaves: that file in place, a partial other.
    staging = models / f"{FETCH_PREFIX}m"
    (staging / "sub").mkdir(parents=True)
    (staging / "config.json").write_bytes((folder / "config.json").read_bytes())
    (staging / ".model.safetensors.part").write_bytes(b"half")
    assert fetch_in_progress(models) == ["m"]
    seen: list[tuple[int, int]] = []
    await fleet.fetch(card, models, lambda done, total: seen.append((done, total)))
    config_size = (folder / "config.json").stat().st_size
    assert seen[0] == (config_size, card.manifest.total_bytes)  # counted, not fetched again
    _same_files(folder, models / "m")
    assert not staging.exists()


async def test_a_corrupted_file_is_refused_and_nothing_lands(
    provisioned_nc: Client, tmp_path: Path
) -> None:
    fleet = FleetModels(provisioned_nc)
    folder = _model_dir(tmp_path, "m", b"x" * 1000)
    card = await fleet.publish(_card("m", folder), folder)
    assert card.manifest is not None
    shard = next(f for f in card.manifest.files if f.path == "model.safetensors")
    bucket = fleet.weights
    info = await bucket.info(shard.sha256)
    chunk = await bucket.js.get_last_msg(bucket.stream, bucket.chunk_subject(info.nuid))
    await bucket.js.delete_msg(bucket.stream, chunk.seq)
    await bucket.js.publish(bucket.chunk_subject(info.nuid), b"y" * 1000)
    models = tmp_path / "node"
    with pytest.raises(ObjectCorrupt):
        await fleet.fetch(card, models)
    assert not (models / "m").exists()
    assert not (models / f"{FETCH_PREFIX}m" / "model.safetensors").exists()


async def test_builtin_cards_are_written_once(provisioned_nc: Client) -> None:
    fleet = FleetModels(provisioned_nc)
    await fleet.ensure_cards(builtin_cards())
    await fleet.ensure_cards(builtin_cards())
    assert set(await fleet.all()) == set(builtin_cards())
