"""What a vision model is shown: the chat with image placeholders, and the images as pixels.

A llava-style model replaces each run of `<image>` tokens in the prompt with the vision
tower's output for one image, so the prompt must carry exactly as many placeholders per image
as the tower makes tokens. The pixels are prepared here rather than by the model's processor
(mlx-vlm 0.7.6's call disagrees with transformers 5 on its keyword arguments): resize to the
tower's square input, scale to [0, 1], normalise with the model's mean and std.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleet.wire.tasks import ChatMessage, ImagePart

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionShape:
    """How one image enters the model."""

    image_size: int
    tokens_per_image: int
    image_token: str
    image_token_id: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD


def read_shape(model_dir: Path, image_token: str = "<image>") -> VisionShape:
    """The shape of a llava-style model directory (config.json, preprocessor_config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    vision = config["vision_config"]
    size, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
    # A CLIP tower adds a CLS token, which "default" drops and "full" keeps; SigLIP has none.
    has_cls = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
    keeps_cls = config.get("vision_feature_select_strategy", "default") == "full"
    extra = 1 if has_cls and keeps_cls else 0
    mean, std = CLIP_MEAN, CLIP_STD
    if (pre := model_dir / "preprocessor_config.json").is_file():
        processor = json.loads(pre.read_text())
        mean = tuple(processor.get("image_mean", mean))  # type: ignore[assignment]
        std = tuple(processor.get("image_std", std))  # type: ignore[assignment]
    return VisionShape(
        image_size=size, tokens_per_image=(size // patch) ** 2 + extra,
        image_token=image_token, image_token_id=int(config["image_token_index"]),
        mean=mean, std=std,
    )


def template_messages(messages: list[ChatMessage], shape: VisionShape) -> list[dict[str, Any]]:
    """The chat for the tokenizer's template: text parts joined, each image a placeholder run
    in its place. Pure."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(
                shape.image_token * shape.tokens_per_image if isinstance(part, ImagePart)
                else part.text
                for part in content
            )
        rendered.append({"role": message.role, "content": content or ""})
    return rendered


def pixels(paths: list[Path], shape: VisionShape) -> np.ndarray:
    """The images as one float32 batch (N, 3, size, size), in the order given."""
    from PIL import Image

    size = shape.image_size
    mean = np.asarray(shape.mean, dtype=np.float32)
    std = np.asarray(shape.std, dtype=np.float32)
    batch = []
    for path in paths:
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
        scaled = np.asarray(rgb, dtype=np.float32) / 255.0
        batch.append(((scaled - mean) / std).transpose(2, 0, 1))
    return np.stack(batch).astype(np.float32)
