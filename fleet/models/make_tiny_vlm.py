"""Build `tiny-vlm`: a small llava-style vision-language model with random weights, offline.

mlx-vlm's own llava class (a CLIP vision tower, a two-layer projector, a llama language
model) at toy sizes: 32x32 images cut into 8x8 patches give 16 image tokens, which the model
puts in place of the `<image>` placeholders in the prompt. The tokenizer is tiny-llm's with
`<image>` added as a special token. Random weights answer noise, but the answer depends on
the image, which is what the tests need. Float32 throughout (only fp32 reaches BLAS).
"""

from __future__ import annotations

import json
from pathlib import Path

from fleet.models.make_tiny import VOCAB_SIZE, _write_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
# CLIP's normalisation: the runner applies the same numbers (fleet/runner/vision_inputs.py).
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def make_tiny_vlm(dest: Path, seed: int = 2) -> Path:
    """Write a directory mlx-vlm's `load` reads, and return it."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    image_token_id = _write_vision_tokenizer(dest)
    config = _llava_config(image_token_id, VOCAB_SIZE + 1)
    _write_weights(dest, config, seed)
    _write_processor(dest)
    return dest


def _write_vision_tokenizer(dest: Path) -> int:
    from tokenizers import Tokenizer

    _write_tokenizer(dest)
    tokenizer = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tokenizer.add_special_tokens([IMAGE_TOKEN])
    tokenizer.save(str(dest / "tokenizer.json"))
    token_id = tokenizer.token_to_id(IMAGE_TOKEN)
    assert token_id == VOCAB_SIZE, token_id  # the one id past tiny-llm's vocabulary
    return token_id


def _llava_config(image_token_id: int, vocab_size: int) -> dict[str, object]:
    return {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": image_token_id,
        "vocab_size": vocab_size,
        "vision_feature_select_strategy": "default",  # drop CLS: one token per patch
        "vision_feature_layer": -1,
        "eos_token_id": [2],  # <|im_end|>, as tiny-llm
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab_size, "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
            "intermediate_size": 64, "num_attention_heads": 2, "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE, "projection_dim": 32,
        },
    }


def _write_weights(dest: Path, config: dict[str, object], seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava

    mx.random.seed(seed)  # module construction draws from mlx's global generator in order
    model_config = llava.ModelConfig.from_dict(config)
    model_config.text_config = llava.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = llava.VisionConfig.from_dict(config["vision_config"])
    model = llava.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_processor(dest: Path) -> None:
    # mlx-vlm's load builds an AutoProcessor from these files; Fleet's runner prepares pixels
    # itself (the processor's call disagrees with transformers 5 on its keyword arguments).
    image_processor = {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD), "do_convert_rgb": True,
    }
    (dest / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2) + "\n")
    processor = {
        "processor_class": "LlavaProcessor", "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default", "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1,
    }
    (dest / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
