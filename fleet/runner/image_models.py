"""Which mflux class runs a model card's family, and how to call it.

Every mflux image class is built the same way (`Class(model_path=..., model_config=...)`) and
generates through `generate_image(seed=, prompt=, num_inference_steps=, height=, width=,
guidance=, ...)`. The families differ in how an edit's input images go in:
- "img2img": one input image, noised part way and denoised from there (`image_path`,
  `image_strength`, where mflux's strength is how much of the input to keep);
- "references": the input images condition every step (`image_paths`); strength does not
  apply and there is no text-to-image.

Weights come only from the local `model_path`, always passed absolute: mflux reads a relative
path that does not exist as a hub id, and no hub is reachable.
"""

from __future__ import annotations

import copy
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from fleet.errors import TaskRejected
from fleet.models.make_tiny_flux import MODEL_CONFIG_FILE
from fleet.runner.engine import Admission
from fleet.wire.cluster import ModelCard
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import ImageEdits, ImageGeneration

EditInputs = Literal["img2img", "references"]
SIZE_MULTIPLE = 16  # mflux rounds any other size down: the image would not be the size asked for
MAX_SIDE = 4096


@dataclass(frozen=True)
class Family:
    model_class: str  # "module:Class" in mflux
    latent_creator: str  # "module:Class" whose unpack_latents turns loop latents into VAE input
    config_keys: tuple[str, ...]  # mflux registry entries of this family; the first is default
    edit_inputs: EditInputs
    text_to_image: bool = True


_FLUX2 = "mflux.models.flux2"
_FLUX2_LATENTS = f"{_FLUX2}.latent_creator.flux2_latent_creator:Flux2LatentCreator"
_KLEIN_CONFIGS = ("flux2-klein-4b", "flux2-klein-9b", "flux2-klein-base-4b", "flux2-klein-base-9b")

FAMILIES: dict[str, Family] = {
    "mflux_flux2": Family(
        f"{_FLUX2}.variants:Flux2Klein", _FLUX2_LATENTS, _KLEIN_CONFIGS, "img2img"
    ),
    "mflux_flux2_edit": Family(
        f"{_FLUX2}.variants:Flux2KleinEdit",
        _FLUX2_LATENTS,
        _KLEIN_CONFIGS,
        "references",
        text_to_image=False,
    ),
    "mflux_flux1": Family(
        "mflux.models.flux.variants.txt2img.flux:Flux1",
        "mflux.models.flux.latent_creator.flux_latent_creator:FluxLatentCreator",
        ("schnell", "dev", "krea-dev"),
        "img2img",
    ),
    "mflux_qwen_image": Family(
        "mflux.models.qwen.variants.txt2img.qwen_image:QwenImage",
        "mflux.models.qwen.latent_creator.qwen_latent_creator:QwenLatentCreator",
        ("qwen-image",),
        "img2img",
    ),
    "mflux_qwen_image_edit": Family(
        "mflux.models.qwen.variants.edit.qwen_image_edit:QwenImageEdit",
        "mflux.models.qwen.latent_creator.qwen_latent_creator:QwenLatentCreator",
        ("qwen-image-edit", "qwen-image-edit-2511"),
        "references",
        text_to_image=False,
    ),
    "mflux_z_image": Family(
        "mflux.models.z_image.variants:ZImage",
        "mflux.models.z_image.latent_creator:ZImageLatentCreator",
        ("z-image-turbo", "z-image"),
        "img2img",
    ),
}


@dataclass(frozen=True)
class ImageRequest:
    """One image to make: everything `generate_image` needs, already resolved."""

    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    input_paths: list[Path] = field(default_factory=list)
    strength: float = 1.0  # Fleet's meaning: how far to move away from the input images


def family_of(card: ModelCard) -> Family:
    try:
        return FAMILIES[card.family]
    except KeyError:
        known = sorted(FAMILIES)
        raise ValueError(f"no mflux class for family {card.family!r}; known: {known}") from None


def check_admission(card: ModelCard, family: Family, admission: Admission) -> None:
    """Raise TaskRejected for a task this model cannot run as asked."""
    task = admission.task
    if not isinstance(task, ImageGeneration | ImageEdits):
        raise TaskRejected(ErrorReason.UNSUPPORTED, f"{card.id} is an image model")
    if isinstance(task, ImageGeneration) and not family.text_to_image:
        raise TaskRejected(ErrorReason.UNSUPPORTED, f"{card.id} edits images; it makes none")
    if task.width % SIZE_MULTIPLE or task.height % SIZE_MULTIPLE:
        message = f"size {task.size}: both sides must be multiples of {SIZE_MULTIPLE}"
        raise TaskRejected(ErrorReason.INVALID_TASK, message)
    if max(task.width, task.height) > MAX_SIDE:
        message = f"size {task.size}: at most {MAX_SIDE} a side"
        raise TaskRejected(ErrorReason.INVALID_TASK, message)
    if not isinstance(task, ImageEdits):
        return
    present = admission.inputs
    missing = [h for h in task.input_images if h not in present or not present[h].exists()]
    if missing:
        raise TaskRejected(ErrorReason.INPUT_MISSING, f"input images not on this node: {missing}")
    if family.edit_inputs == "img2img" and len(task.input_images) > 1:
        message = f"{card.id} edits one input image at a time"
        raise TaskRejected(ErrorReason.UNSUPPORTED, message)


def load_model(card: ModelCard, model_path: Path) -> Any:
    """Build the family's mflux class from local weights, evaluated so nothing loads later."""
    import mlx.core as mx
    from mflux.models.common.config.model_config import ModelConfig

    if mx.default_device() == mx.cpu:
        # Only float32 reaches BLAS on the CPU; bfloat16 runs a reference loop many times slower.
        # Process-wide, which is right for a runner: one process, one model.
        ModelConfig.precision = mx.float32
    model_class = _import(family_of(card).model_class)
    model = model_class(
        model_path=str(model_path.absolute()), model_config=model_config(card, model_path)
    )
    mx.eval(model.parameters())
    return model


def model_config(card: ModelCard, model_path: Path) -> Any:
    """mflux's config for the card: the model's own overrides, else the registry entry."""
    from mflux.models.common.config.model_config import AVAILABLE_MODELS

    family = family_of(card)
    overrides_file = model_path / MODEL_CONFIG_FILE
    if overrides_file.exists():
        saved = json.loads(overrides_file.read_text())
        config = copy.copy(AVAILABLE_MODELS[saved["base_model"]])
        config.transformer_overrides = saved.get("transformer_overrides", {})
        config.text_encoder_overrides = saved.get("text_encoder_overrides", {})
        return config
    # A card whose source names an upstream repo ("black-forest-labs/FLUX.2-klein-9B") picks
    # that entry; anything else gets the family's default geometry.
    for key in family.config_keys:
        if AVAILABLE_MODELS[key].model_name.lower() == card.source.lower():
            return AVAILABLE_MODELS[key]
    return AVAILABLE_MODELS[family.config_keys[0]]


def generate(model: Any, family: Family, request: ImageRequest) -> Image.Image:
    """Run one generation; the model's registered callbacks see every denoising step."""
    arguments: dict[str, Any] = {
        "seed": request.seed,
        "prompt": request.prompt,
        "num_inference_steps": request.steps,
        "height": request.height,
        "width": request.width,
        "guidance": request.guidance,
    }
    if request.input_paths and family.edit_inputs == "references":
        arguments["image_paths"] = [str(path) for path in request.input_paths]
    elif request.input_paths:
        arguments["image_path"] = str(request.input_paths[0])
        arguments["image_strength"] = 1.0 - request.strength
    return model.generate_image(**arguments).image


def decode_preview(
    model: Any, family: Family, latents: Any, width: int, height: int
) -> Image.Image:
    """The image the latents of an unfinished loop stand for: one VAE decode."""
    from mflux.utils.image_util import ImageUtil

    unpacked = _import(family.latent_creator).unpack_latents(
        latents=latents, height=height, width=width
    )
    vae = model.vae
    # Flux2 keeps its latents patchified (4x the VAE's channels) until decode_packed_latents.
    if hasattr(vae, "decode_packed_latents") and unpacked.shape[1] > vae.latent_channels:
        decoded = vae.decode_packed_latents(unpacked)
    else:
        decoded = vae.decode(unpacked)
    return ImageUtil.to_pil(decoded)


def _import(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)
