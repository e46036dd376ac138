"""Model cards: the built-in set, custom cards from local directories and the HF cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleet.errors import InvalidRequest, ModelNotFound
from fleet.models.catalog import (
    add_custom_card,
    all_cards,
    builtin_cards,
    bytes_outside_layers,
    get_card,
)

# mlx-lm is imported where used, not at the top: collection imports this module in every
# xdist worker, and mlx-lm pulls in transformers (1.2 s of CPU; issue 28).

BUILT_IN = {
    "smollm2-135m", "tiny-llm", "tiny-flux2", "tiny-embed", "smollm2-135m-embed", "tiny-vlm",
    "flux1-schnell", "flux1-dev", "flux2-klein-4b", "qwen-image", "z-image-turbo",
}  # fmt: skip


def test_built_in_cards_are_the_documented_set():
    cards = builtin_cards()

    assert set(cards) == BUILT_IN
    for card in cards.values():
        assert card.is_image == (card.image_defaults is not None), card.id
        assert card.family.startswith("mflux_") == card.is_image, card.id
        assert card.is_embedding == (card.embedding is not None), card.id
        assert card.is_vision == ("vision" in card.capabilities), card.id


def test_tiny_flux2_card_asks_for_small_fast_images():
    card = get_card("tiny-flux2")

    assert card.tasks == ["text_to_image", "image_to_image"]
    assert card.family == "mflux_flux2"
    assert card.capabilities == ["partial_images"]
    assert card.image_defaults is not None
    assert (card.image_defaults.steps, card.image_defaults.size) == (4, "128x128")


def test_unknown_id_is_model_not_found(tmp_path: Path):
    with pytest.raises(ModelNotFound) as caught:
        get_card("no-such-model", tmp_path)

    assert caught.value.http_status == 404


def test_custom_card_from_a_local_mlx_lm_directory(tmp_path: Path, tiny_llm_dir: Path):
    card = add_custom_card(tmp_path, "my-tiny", tiny_llm_dir)

    assert card == get_card("my-tiny", tmp_path)
    assert "my-tiny" not in builtin_cards()
    assert set(all_cards(tmp_path)) == BUILT_IN | {"my-tiny"}
    assert (card.family, card.tasks, card.source) == (
        "mlx_lm", ["text_generation"], str(tiny_llm_dir.resolve())
    )  # fmt: skip
    assert (card.n_layers, card.hidden_size, card.context_length) == (2, 64, 2048)
    assert card.capabilities == ["tools"]
    assert card.size_bytes == (tiny_llm_dir / "model.safetensors").stat().st_size


def test_custom_card_reads_quantization_from_the_config(tmp_path: Path, tiny_llm_dir: Path):
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    config = json.loads((tiny_llm_dir / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    (quantized / "config.json").write_text(json.dumps(config))

    card = add_custom_card(tmp_path / "data", "tiny-q4", quantized)

    assert card.quantization == "4bit"
    assert card.capabilities == []  # no tokenizer_config.json, so no template with tools


def test_a_weights_file_that_is_not_safetensors_counts_as_layers(tmp_path: Path) -> None:
    """The card describes what it can read; loading is where a broken file is reported."""
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)  # a header longer than the file
    (folder / "small.safetensors").write_bytes(b"\x01")
    (folder / "text.safetensors").write_bytes((8).to_bytes(8, "little") + b"not json")
    assert bytes_outside_layers(folder) == 0


def _fake_hf_cache(hub: Path, repo_id: str, model_dir: Path, revision: str = "0123abcd") -> Path:
    """The layout huggingface_hub writes: files in blobs/, snapshots/<rev>/ linking to them."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, source in enumerate(sorted(model_dir.iterdir())):
        blob = repo / "blobs" / f"blob{index}"
        blob.write_bytes(source.read_bytes())
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    return home


@pytest.mark.parametrize("given", ["repo id", "cache entry", "snapshot"])
def test_custom_card_from_the_local_hf_cache(
    given: str, tmp_path: Path, hf_home: Path, tiny_llm_dir: Path
):
    snapshot = _fake_hf_cache(hf_home / "hub", "acme/tiny-chat", tiny_llm_dir)
    path = {
        "repo id": "acme/tiny-chat",
        "cache entry": str(snapshot.parent.parent),
        "snapshot": str(snapshot),
    }[given]

    card = add_custom_card(tmp_path / "data", "acme-tiny", path)

    assert card.source == str(snapshot.resolve())
    assert card.name == "acme/tiny-chat"
    assert card.size_bytes == (tiny_llm_dir / "model.safetensors").stat().st_size
    assert card.n_layers == 2


def test_a_card_from_the_hf_cache_loads_with_mlx_lm(
    tmp_path: Path, hf_home: Path, tiny_llm_dir: Path
):
    from mlx_lm import load
    _fake_hf_cache(hf_home / "hub", "acme/tiny-chat", tiny_llm_dir)
    card = add_custom_card(tmp_path / "data", "acme-tiny", "acme/tiny-chat")

    model, tokenizer = load(card.source)

    assert len(model.layers) == card.n_layers
    assert tokenizer.has_tool_calling


def test_repo_missing_from_the_cache_is_model_not_found(tmp_path: Path, hf_home: Path):
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        add_custom_card(tmp_path, "absent", "acme/absent")


def test_custom_card_from_a_diffusers_directory_names_the_mflux_family(tmp_path: Path):
    model_dir = tmp_path / "FLUX.1-schnell"
    (model_dir / "transformer").mkdir(parents=True)
    (model_dir / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (model_dir / "transformer" / "weights.safetensors").write_bytes(b"x" * 10)

    card = add_custom_card(tmp_path / "data", "my-schnell", model_dir)

    assert (card.family, card.size_bytes, card.is_image) == ("mflux_flux1", 10, True)


@pytest.mark.parametrize(
    ("model_id", "why"),
    [("tiny-llm", "reserved"), ("custom", "reserved"), ("Not A Slug", "cannot make a card")],
)
def test_bad_ids_are_invalid_requests(model_id: str, why: str, tmp_path: Path, tiny_llm_dir: Path):
    with pytest.raises(InvalidRequest, match=why):
        add_custom_card(tmp_path, model_id, tiny_llm_dir)

    assert not list(tmp_path.rglob("*.json"))


def test_a_directory_without_a_model_is_an_invalid_request(tmp_path: Path):
    (tmp_path / "empty").mkdir()

    with pytest.raises(InvalidRequest, match="neither config"):
        add_custom_card(tmp_path, "empty", tmp_path / "empty")
