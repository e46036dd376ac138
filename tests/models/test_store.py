"""ensure_model: built-in models built once, atomically, under a lock; others found on disk."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest

from fleet.errors import ModelNotFound
from fleet.models.catalog import add_custom_card, get_card
from fleet.models.store import build_once, ensure_model, models_on_disk
from fleet.wire.cluster import ModelCard


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "data" / "models"


def test_tiny_llm_is_built_on_first_use_then_reused(models_dir: Path, tiny_llm_dir: Path):
    card = get_card("tiny-llm")

    path = ensure_model(card, models_dir)
    first_build = (path / "model.safetensors").stat().st_mtime_ns

    assert path == models_dir / "tiny-llm"
    assert (path / "model.safetensors").read_bytes() == (
        tiny_llm_dir / "model.safetensors"
    ).read_bytes()
    assert ensure_model(card, models_dir) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == first_build
    assert models_on_disk(models_dir) == ["tiny-llm"]
    assert sorted(entry.name for entry in models_dir.iterdir()) == [".lock-tiny-llm", "tiny-llm"]


def test_a_failed_build_leaves_nothing_behind(models_dir: Path):
    def crashing_builder(dest: Path) -> Path:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once("tiny-llm", models_dir, crashing_builder)

    assert not (models_dir / "tiny-llm").exists()
    assert [entry.name for entry in models_dir.iterdir()] == [".lock-tiny-llm"]


def test_staging_left_by_a_dead_builder_is_cleared(models_dir: Path):
    leftover = models_dir / ".building-tiny-llm-999-dead"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")

    def builder(dest: Path) -> Path:
        (dest / "weights").write_text("w")
        return dest

    path = build_once("tiny-llm", models_dir, builder)

    assert not leftover.exists()
    assert (path / "weights").read_text() == "w"


def test_a_second_worker_waits_for_the_lock_and_uses_the_first_ones_model(models_dir: Path):
    models_dir.mkdir(parents=True)
    built_by_second: list[Path] = []

    def second_builder(dest: Path) -> Path:
        built_by_second.append(dest)
        return dest

    result: list[Path] = []
    with open(models_dir / ".lock-tiny-llm", "a") as held:
        # The first worker holds the lock, as a converting worker in another process would.
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(
            target=lambda: result.append(build_once("tiny-llm", models_dir, second_builder))
        )
        second.start()
        (models_dir / "tiny-llm").mkdir()
        fcntl.flock(held, fcntl.LOCK_UN)
    second.join(timeout=30)

    assert result == [models_dir / "tiny-llm"]
    assert built_by_second == []


def test_a_custom_card_resolves_to_its_path(tmp_path: Path, models_dir: Path, tiny_llm_dir: Path):
    card = add_custom_card(models_dir.parent, "my-tiny", tiny_llm_dir)

    assert ensure_model(card, models_dir) == tiny_llm_dir.resolve()
    assert models_on_disk(models_dir) == ["my-tiny"]


def test_hub_model_without_local_weights_is_model_not_found(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))

    with pytest.raises(ModelNotFound, match="no weights on this machine"):
        ensure_model(get_card("flux1-schnell"), models_dir)
    assert models_on_disk(models_dir) == []


def test_hub_model_placed_in_the_models_dir_is_used(models_dir: Path):
    placed = models_dir / "z-image-turbo"
    placed.mkdir(parents=True)

    assert ensure_model(get_card("z-image-turbo"), models_dir) == placed
    assert "z-image-turbo" in models_on_disk(models_dir)


def test_hub_model_in_the_hf_cache_is_used(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    hub = tmp_path / "hub"
    snapshot = hub / "models--black-forest-labs--FLUX.1-dev" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    assert ensure_model(get_card("flux1-dev"), models_dir) == snapshot.resolve()


def test_a_built_in_card_without_a_builder_is_model_not_found(models_dir: Path):
    card = ModelCard(
        id="mystery", name="?", tasks=["text_generation"], family="mlx_lm", source="built-in"
    )

    with pytest.raises(ModelNotFound):
        ensure_model(card, models_dir)


def test_tiny_flux2_is_built_by_its_maker_on_first_use(models_dir: Path):
    pytest.importorskip("mflux")

    path = ensure_model(get_card("tiny-flux2"), models_dir)

    assert path == models_dir / "tiny-flux2"
    assert list(path.rglob("*.safetensors"))
    assert models_on_disk(models_dir) == ["tiny-flux2"]
