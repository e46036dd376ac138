"""tiny-flux2: a random FLUX.2-klein in mflux's saved layout, loaded by mflux's own loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.models.make_tiny_flux import MODEL_CONFIG_FILE, make_tiny_flux2, parameter_count


@pytest.fixture(scope="module")
def tiny_flux2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_flux2(tmp_path_factory.mktemp("tiny-flux2") / "tiny-flux2")


def _weight_files(model_dir: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(model_dir)): path.read_bytes()
        for path in sorted(model_dir.rglob("*"))
        if path.is_file()
    }


def test_layout_is_mflux_saved_model(tiny_flux2: Path):
    for component in ("vae", "transformer", "text_encoder"):
        index = json.loads((tiny_flux2 / component / "model.safetensors.index.json").read_text())
        assert index["metadata"]["quantization_level"] == "None"
        assert set(index["weight_map"].values()) == {"0.safetensors"}
    assert (tiny_flux2 / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((tiny_flux2 / MODEL_CONFIG_FILE).read_text())["base_model"] == (
        "flux2-klein-4b"
    )
    assert 500_000 < parameter_count(tiny_flux2) < 1_500_000


def test_same_seed_same_bytes_other_seed_other_weights(tiny_flux2: Path, tmp_path: Path):
    again = make_tiny_flux2(tmp_path / "again", seed=0)
    other = make_tiny_flux2(tmp_path / "other", seed=1)

    assert _weight_files(again) == _weight_files(tiny_flux2)
    other_files = _weight_files(other)
    assert other_files["vae/0.safetensors"] != _weight_files(tiny_flux2)["vae/0.safetensors"]


def test_mflux_loads_it_and_generates(tiny_flux2: Path):
    from mflux.models.flux2.variants import Flux2Klein

    from fleet.runner.image_models import model_config
    from fleet.wire.cluster import ModelCard

    card = ModelCard(
        id="tiny-flux2", name="t", tasks=["text_to_image"], family="mflux_flux2", source="built-in"
    )
    model = Flux2Klein(model_path=str(tiny_flux2), model_config=model_config(card, tiny_flux2))
    image = model.generate_image(
        seed=3, prompt="a red fox", num_inference_steps=2, height=64, width=80
    )

    assert image.image.size == (80, 64)
    # Random weights give noise, not a flat colour: the VAE did decode something.
    assert len(set(image.image.tobytes())) > 50
