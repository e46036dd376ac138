"""Build `tiny-llm`: a small qwen2-style mlx-lm model with random weights, made offline.

No hub is reachable, so the tests, the demo and the benchmarks need a text model that can be
made from nothing: a byte-level BPE tokenizer trained here on a few built-in lines, a ChatML
chat template that also renders tools, and random weights from mlx-lm's own qwen2 class saved
with mlx-lm's save helper (which also writes the safetensors index sharded loading needs).
Everything is float32 because only fp32 goes through BLAS on the CPU.

The same seed and size give the same bytes, so two workers that build it agree on the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fleet.models.chat_template import CHATML_WITH_TOOLS

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain added tokens (not special): they survive decoding, so a tool call reads as text.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog.
Hello! How can I help you today?
The capital of France is Paris, and the capital of Italy is Rome.
A fleet of workers pulls tasks from a queue and streams tokens back.
Messages travel over NATS; JetStream keeps them until a worker acks.
Write a short poem about the sea, the wind and the stars at night.
What is two plus two? Two plus two is four. 1 2 3 4 5 6 7 8 9 10
Sure, here is a list: apples, bananas, cherries, dates and figs.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
You are a helpful assistant. Answer the question in one sentence.
Thank you very much. You are welcome; have a nice day!
def add(a, b): return a + b  # small code helps the tokenizer see symbols
Images are made from noise, step by step, by a diffusion model.
"""


@dataclass(frozen=True)
class TinyShape:
    """The architecture knobs that set how long one decode step takes."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


# "tiny": a decode step of a few ms for tests; "bench": about 10 ms a step on two CPU cores,
# slow enough that batching and overheads show up in a benchmark.
TINY_SHAPES: dict[str, TinyShape] = {
    "tiny": TinyShape(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    ),
    "bench": TinyShape(
        hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1024
    ),
}


def make_tiny_llm(dest: Path, seed: int = 0, size: str | TinyShape = "tiny") -> Path:
    """Write a loadable mlx-lm model directory at `dest` and return it."""
    shape = TINY_SHAPES[size] if isinstance(size, str) else size
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(dest)
    config = _qwen2_config(shape)
    _write_weights(dest, config, seed)
    return dest


def _write_tokenizer(dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    tokenizer.add_tokens(list(TOOL_TOKENS))
    tokenizer.save(str(dest / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_WITH_TOOLS,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _qwen2_config(shape: TinyShape) -> dict[str, object]:
    # Token ids follow the trainer: special tokens first, in SPECIAL_TOKENS order.
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    }


def _write_weights(dest: Path, config: dict[str, object], seed: int) -> None:
    import mlx.core as mx
    from mlx_lm.models import qwen2
    from mlx_lm.utils import save_config, save_model

    # Module construction draws from mlx's global generator in a fixed order.
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(dest, model)
    save_config(dict(config), config_path=dest / "config.json")
