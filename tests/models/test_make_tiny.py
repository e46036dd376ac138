"""tiny-llm: deterministic bytes, loads and generates with mlx-lm, ChatML template with tools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import pytest

from fleet.models.catalog import bytes_outside_layers, get_card
from fleet.models.make_tiny import EOS_TOKEN, VOCAB_SIZE

# mlx-lm is imported where used, not at the top: collection imports this module in every
# xdist worker, and mlx-lm pulls in transformers (1.2 s of CPU; issue 28).
if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@pytest.fixture(scope="module")
def tiny(tiny_llm_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    from mlx_lm import load
    return load(str(tiny_llm_dir))


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_a_build_in_another_process_gives_identical_bytes(tiny_llm_dir: Path, tmp_path: Path):
    # Another process: the tokenizer trainer's hash maps are seeded per process.
    script = (
        "import sys; from pathlib import Path; from fleet.models.make_tiny import "
        "make_tiny_llm; make_tiny_llm(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "again")], check=True)

    assert _file_bytes(tmp_path / "again") == _file_bytes(tiny_llm_dir)


def test_another_seed_gives_other_weights(tiny_llm_dir: Path, tmp_path: Path):
    from fleet.models.make_tiny import make_tiny_llm

    other = make_tiny_llm(tmp_path / "seed1", seed=1)

    assert (other / "tokenizer.json").read_bytes() == (tiny_llm_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (
        tiny_llm_dir / "model.safetensors"
    ).read_bytes()


def test_directory_is_float32_with_an_index_and_matches_its_card(tiny_llm_dir: Path):
    weights = mx.load(str(tiny_llm_dir / "model.safetensors"))
    index = json.loads((tiny_llm_dir / "model.safetensors.index.json").read_text())
    config = json.loads((tiny_llm_dir / "config.json").read_text())
    card = get_card("tiny-llm")

    assert {array.dtype for array in weights.values()} == {mx.float32}
    assert set(index["weight_map"]) == set(weights)
    assert (card.n_layers, card.hidden_size) == (
        config["num_hidden_layers"],
        config["hidden_size"],
    )
    assert card.size_bytes == (tiny_llm_dir / "model.safetensors").stat().st_size
    outside = [name for name in weights if ".layers." not in name]
    assert card.shared_bytes == sum(weights[name].nbytes for name in outside) > 0
    assert card.shared_bytes == bytes_outside_layers(tiny_llm_dir)


def test_greedy_generation_streams_the_requested_tokens(tiny):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    model, tokenizer = tiny
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True
    )
    eos = next(iter(tokenizer.eos_token_ids))

    def never_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        # Random weights may pick EOS at any step; the test wants a fixed count.
        return logits.at[..., eos].add(-1e9)

    responses = list(
        stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=16,
            sampler=make_sampler(temp=0.0),
            logits_processors=[never_eos],
        )
    )

    assert len(responses) == 16
    assert responses[-1].finish_reason == "length"
    assert all(0 <= r.token < VOCAB_SIZE and r.token != eos for r in responses)


def test_chat_template_renders_chatml(tiny):
    _, tokenizer = tiny
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]

    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_renders_tools_and_tool_calls(tiny):
    _, tokenizer = tiny
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "21 C"},
    ]

    text = tokenizer.apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=False
    )

    assert text.startswith("<|im_start|>system\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert text.endswith("<|im_start|>tool\n21 C<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_parser('{"name": "f", "arguments": {}}') == {"name": "f", "arguments": {}}


def test_special_tokens_are_single_ids_and_eos_is_im_end(tiny):
    _, tokenizer = tiny

    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) in tokenizer.eos_token_ids
    assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) == 1
    text = "The capital of France is Paris."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
