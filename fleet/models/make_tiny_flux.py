"""Build `tiny-flux2`: a FLUX.2-klein with random weights (~0.73M parameters), made offline.

mflux's klein initializer sizes the transformer and the text encoder from the ModelConfig's
overrides, so those two are simply built small. The VAE is different: the initializer always
builds `Flux2VAE()` at full size (128-512 channels, 84M parameters) and then `update()`s it with
whatever the checkpoint holds, which mlx does without comparing shapes. A VAE saved at 32
channels everywhere therefore replaces the full one wholesale, as long as it has a parameter at
every path the full one has: the full layout keeps a 1x1 shortcut conv wherever its channel
count changes, so the tiny VAE gets those too (32 -> 32). 32 is the floor: GroupNorm uses 32
groups.

The files are written by mflux's own ModelSaver (one folder per component with shards carrying
mflux's metadata plus an index; the tokenizer via save_pretrained). mflux keeps no config beside
a saved model, so `fleet_mflux.json` records the base model and the overrides the loader needs;
`fleet.runner.image` reads it. Output is coloured noise, as random weights must give.

The same seed gives the same bytes, so two workers that build it agree on the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MODEL_CONFIG_FILE = "fleet_mflux.json"
BASE_MODEL = "flux2-klein-4b"
VAE_CHANNELS = 32
TEXT_HIDDEN_SIZE = 16
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's template reduced to what klein's prompt encoder renders: one user turn, then the
# assistant prefix (the real template's thinking switch has nothing to switch here).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_ENCODER_OVERRIDES: dict[str, Any] = {
    # The byte alphabet plus the special tokens: see _tokenizer.
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": TEXT_HIDDEN_SIZE,
    # klein reads the hidden states after layers 9, 18 and 27, so 28 layers is the minimum.
    "num_hidden_layers": 28,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "max_position_embeddings": 1024,
}
TRANSFORMER_OVERRIDES: dict[str, Any] = {
    "num_layers": 2,
    "num_single_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    # The rope axes split the head dimension four ways, as in the full model.
    "axes_dims_rope": [4, 4, 4, 4],
    # klein stacks three hidden states of the text encoder side by side.
    "joint_attention_dim": 3 * TEXT_HIDDEN_SIZE,
    "timestep_guidance_channels": 32,
}


def make_tiny_flux2(dest: Path, seed: int = 0) -> Path:
    """Write a klein model directory at `dest` that mflux's loaders accept, and return it."""
    import mlx.core as mx
    from mflux.models.common.weights.saving.model_saver import ModelSaver
    from mflux.models.flux2.model.flux2_text_encoder.qwen3_text_encoder import Qwen3TextEncoder
    from mflux.models.flux2.model.flux2_transformer.transformer import Flux2Transformer
    from mflux.models.flux2.weights.flux2_weight_definition import Flux2KleinWeightDefinition

    dest = Path(dest).absolute()
    dest.mkdir(parents=True, exist_ok=True)
    # Module construction draws from mlx's global generator in a fixed order.
    mx.random.seed(seed)
    components = SimpleNamespace(
        vae=_tiny_vae(),
        transformer=Flux2Transformer(**TRANSFORMER_OVERRIDES),
        text_encoder=Qwen3TextEncoder(**TEXT_ENCODER_OVERRIDES),
        tokenizers={"qwen3": SimpleNamespace(tokenizer=_tokenizer())},
    )
    ModelSaver.save_model(
        model=components,
        bits=None,
        base_path=str(dest),
        weight_definition=Flux2KleinWeightDefinition,
    )
    model_config = {
        "base_model": BASE_MODEL,
        "transformer_overrides": TRANSFORMER_OVERRIDES,
        "text_encoder_overrides": TEXT_ENCODER_OVERRIDES,
    }
    (dest / MODEL_CONFIG_FILE).write_text(json.dumps(model_config, indent=2) + "\n")
    return dest


def parameter_count(model_dir: Path) -> int:
    """How many weights the saved components hold."""
    import mlx.core as mx

    shards = sorted(Path(model_dir).glob("*/*.safetensors"))
    return sum(array.size for shard in shards for array in mx.load(str(shard)).values())


def _tiny_vae() -> Any:
    from mflux.models.flux2.model.flux2_vae.common.resnet_block_2d import Flux2ResnetBlock2D
    from mflux.models.flux2.model.flux2_vae.encoder.encoder import Flux2Encoder
    from mflux.models.flux2.model.flux2_vae.vae import Flux2VAE
    from mlx import nn
    from mlx.utils import tree_flatten

    channels = (VAE_CHANNELS,) * 4
    vae = Flux2VAE(decoder_block_out_channels=channels)
    vae.encoder = Flux2Encoder(block_out_channels=channels)
    # Built lazily: mlx draws no random numbers for the full-size VAE unless they are evaluated.
    full_size = Flux2VAE()
    tiny_modules = dict(vae.named_modules())
    for name, module in full_size.named_modules():
        if isinstance(module, Flux2ResnetBlock2D) and module.conv_shortcut is not None:
            tiny_modules[name].conv_shortcut = nn.Conv2d(VAE_CHANNELS, VAE_CHANNELS, kernel_size=1)
    tiny_names = {name for name, _ in tree_flatten(vae.parameters())}
    full_names = {name for name, _ in tree_flatten(full_size.parameters())}
    if tiny_names != full_names:
        raise RuntimeError(
            f"tiny VAE layout differs from mflux's: {sorted(tiny_names ^ full_names)}"
        )
    return vae


def _tokenizer() -> Any:
    """A byte-level BPE without merges: deterministic, and any prompt encodes (one id a byte)."""
    import transformers
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {SPECIAL_TOKENS[0]: 0} | {char: i + 1 for i, char in enumerate(alphabet)}
    tokenizer = transformers.Qwen2Tokenizer(
        vocab=vocab, merges=[], additional_special_tokens=list(SPECIAL_TOKENS[1:])
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != TEXT_ENCODER_OVERRIDES["vocab_size"]:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} ids, the text encoder embeds fewer")
    return tokenizer
