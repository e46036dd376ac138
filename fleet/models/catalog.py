"""Model cards: the built-in ones shipped as data files, plus custom ones added at run time.

Built-in cards live in `fleet/models/cards/<id>.json`; custom cards are written to
`<data_dir>/models/custom/<id>.json` by `add_custom_card`, which reads a local model directory
(an mlx-lm directory, or a snapshot in the local Hugging Face cache) and describes it.

Image model families name the mflux class that runs them:
mflux_flux1 -> Flux1, mflux_flux2 -> Flux2Klein, mflux_qwen_image -> QwenImage,
mflux_z_image -> ZImage. Text families (mlx_lm, gguf_llama) both load with `mlx_lm.load`
once `fleet.models.store` has made them a local directory.

Aliases: other names a request may give for a model (a client's own default model, such as
Claude Code's `claude-*` names), from a card's `aliases` and from this data dir's
`models/aliases.json` (`{"claude-*": "smollm2-135m"}`, which wins over the cards). `*` and `?`
are wildcards. `resolve_alias` is the one rule, pure: an exact alias before a pattern, the
longest pattern first.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from fnmatch import fnmatchcase
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from fleet.errors import InvalidRequest, ModelNotFound
from fleet.models.hf_cache import repo_id_of_snapshot, resolve_local_model
from fleet.wire.cluster import EmbeddingSpec, ModelCard

CUSTOM_DIR_NAME = "custom"
Pooling = Literal["mean", "last"]
# diffusers' pipeline class (model_index.json) -> the family whose mflux class loads it.
DIFFUSERS_FAMILIES = {
    "FluxPipeline": "mflux_flux1",
    "Flux2KleinPipeline": "mflux_flux2",
    "QwenImagePipeline": "mflux_qwen_image",
    "ZImagePipeline": "mflux_z_image",
}


@cache
def builtin_cards() -> dict[str, ModelCard]:
    folder = resources.files("fleet.models") / "cards"
    cards = [
        ModelCard.model_validate_json(entry.read_text())
        for entry in folder.iterdir()
        if entry.name.endswith(".json")
    ]
    return {card.id: card for card in sorted(cards, key=lambda card: card.id)}


def custom_cards_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "models" / CUSTOM_DIR_NAME


def custom_cards(data_dir: Path) -> dict[str, ModelCard]:
    folder = custom_cards_dir(data_dir)
    if not folder.is_dir():
        return {}
    cards = [ModelCard.model_validate_json(path.read_bytes()) for path in folder.glob("*.json")]
    return {card.id: card for card in sorted(cards, key=lambda card: card.id)}


ALIASES_FILE = "aliases.json"


def aliases_path(data_dir: Path) -> Path:
    return Path(data_dir) / "models" / ALIASES_FILE


def configured_aliases(data_dir: Path) -> dict[str, str]:
    """Alias (or pattern) → model id, from `<data_dir>/models/aliases.json`; none when absent."""
    path = aliases_path(data_dir)
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidRequest(f"{path}: not JSON: {exc}") from None
    if not isinstance(table, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in table.items()):
        raise InvalidRequest(f'{path}: expected {{"alias or pattern": "model id", ...}}')
    return table


def alias_table(cards: Mapping[str, ModelCard], configured: Mapping[str, str]) -> dict[str, str]:
    """Every alias → the model it names: the cards' own, then the configured ones over them."""
    table = {alias: card.id for card in cards.values() for alias in card.aliases}
    table.update(configured)
    return table


def resolve_alias(name: str, table: Mapping[str, str]) -> str | None:
    """The model `name` is an alias of: an exact alias first, then the longest matching
    pattern (ties: in name order), so `claude-3-haiku*` wins over `claude-*`. Pure."""
    if name in table:
        return table[name]
    patterns = sorted((p for p in table if "*" in p or "?" in p), key=lambda p: (-len(p), p))
    return next((table[p] for p in patterns if fnmatchcase(name, p)), None)


def aliases_of(model_id: str, table: Mapping[str, str]) -> list[str]:
    return sorted(alias for alias, target in table.items() if target == model_id)


def all_cards(data_dir: Path | None = None) -> dict[str, ModelCard]:
    """Every card this node knows: built-in first, then custom ones from `data_dir`."""
    cards = dict(builtin_cards())
    if data_dir is not None:
        cards.update(custom_cards(data_dir))
    return cards


def get_card(model_id: str, data_dir: Path | None = None) -> ModelCard:
    card = all_cards(data_dir).get(model_id)
    if card is None:
        raise ModelNotFound(f"no model card named {model_id!r}")
    return card


def add_custom_card(
    data_dir: Path, model_id: str, path: Path | str, embeddings: Pooling | None = None
) -> ModelCard:
    """Describe the model at `path` (or a repo id found in the local HF cache) and save it;
    with `embeddings` (a pooling), as an embedding model rather than a text generator."""
    if model_id in builtin_cards() or model_id == CUSTOM_DIR_NAME:
        raise InvalidRequest(f"{model_id!r} is reserved: choose another id")
    model_dir = resolve_local_model(path)
    try:
        card = describe_model_dir(model_id, model_dir)
        if embeddings is not None:
            card = as_embedder(card, embeddings)
    except ValidationError as exc:
        raise InvalidRequest(f"cannot make a card for {model_id!r}: {exc}") from exc
    folder = custom_cards_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{model_id}.json.tmp"
    staging.write_text(card.model_dump_json(indent=2) + "\n")
    staging.replace(folder / f"{model_id}.json")
    return card


def as_embedder(card: ModelCard, pooling: Pooling) -> ModelCard:
    """A text model's card as an embedding model's: its last hidden states pooled into
    vectors of its hidden size (fleet/runner/embed.py), never cut to fewer dimensions (a model
    is not trained for that unless its card is written to say so)."""
    if card.is_image or card.hidden_size <= 0:
        raise InvalidRequest(f"{card.id}: only a text model with a known hidden size can embed")
    spec = EmbeddingSpec(pooling=pooling, dimensions=card.hidden_size)
    return ModelCard.model_validate(
        {**card.model_dump(), "tasks": ["embeddings"], "capabilities": [], "embedding": spec}
    )


def describe_model_dir(model_id: str, model_dir: Path) -> ModelCard:
    if (model_dir / "model_index.json").is_file():
        return _describe_diffusers_dir(model_id, model_dir)
    if (model_dir / "config.json").is_file():
        return _describe_mlx_lm_dir(model_id, model_dir)
    raise InvalidRequest(f"{model_dir} holds neither config.json nor model_index.json")


def _describe_mlx_lm_dir(model_id: str, model_dir: Path) -> ModelCard:
    config = json.loads((model_dir / "config.json").read_text())
    # Multimodal configs keep the language model's sizes in a nested text_config.
    text_config = config.get("text_config", config)
    quantization = config.get("quantization") or config.get("quantization_config")
    capabilities = []
    if "tools" in _chat_template(model_dir):
        capabilities.append("tools")
    if "vision_config" in config:
        capabilities.append("vision")
    return ModelCard(
        id=model_id,
        name=_display_name(model_dir),
        tasks=["text_generation"],
        family="mlx_lm",
        source=str(model_dir),
        size_bytes=_weights_size(model_dir),
        shared_bytes=bytes_outside_layers(model_dir),
        n_layers=int(text_config.get("num_hidden_layers") or text_config.get("n_layers") or 0),
        hidden_size=int(text_config.get("hidden_size") or text_config.get("d_model") or 0),
        context_length=int(text_config.get("max_position_embeddings") or 2048),
        quantization=f"{quantization['bits']}bit" if quantization else "none",
        capabilities=capabilities,
    )


def _describe_diffusers_dir(model_id: str, model_dir: Path) -> ModelCard:
    pipeline = json.loads((model_dir / "model_index.json").read_text()).get("_class_name", "")
    family = DIFFUSERS_FAMILIES.get(pipeline)
    if family is None:
        known = ", ".join(sorted(DIFFUSERS_FAMILIES))
        raise InvalidRequest(f"{model_dir} is a {pipeline or 'unknown'} pipeline; known: {known}")
    return ModelCard(
        id=model_id,
        name=_display_name(model_dir),
        tasks=["text_to_image", "image_to_image"],
        family=family,
        source=str(model_dir),
        size_bytes=_weights_size(model_dir),
        capabilities=["partial_images"],
    )


def _display_name(model_dir: Path) -> str:
    return repo_id_of_snapshot(model_dir) or model_dir.name


def _chat_template(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = json.loads(tokenizer_config.read_text()).get("chat_template") or ""
        # A few tokenizers keep a list of named templates.
        return template if isinstance(template, str) else json.dumps(template)
    return ""


def bytes_outside_layers(model_dir: Path) -> int:
    """Bytes of the tensors not in a numbered layer (`.layers.<n>.`): the embedding, the final
    norm and an untied head, which every pipeline rank holds (fleet.runner.pipeline).

    Read from each safetensors header (an 8-byte little-endian length, then JSON naming every
    tensor with its byte range): the `safetensors` package tells shapes and dtypes but not
    the bytes a quantized pack takes, and this reads no tensor data."""
    total = 0
    for path in model_dir.rglob("*.safetensors"):
        for name, tensor in _safetensors_header(path).items():
            if name != "__metadata__" and not _IN_A_LAYER.search(name):
                try:
                    start, end = tensor["data_offsets"]
                    total += int(end) - int(start)
                except (KeyError, TypeError, ValueError):
                    continue
    return total


_IN_A_LAYER = re.compile(r"\.layers\.\d+\.")
_MAX_HEADER_BYTES = 100_000_000  # the format's own limit


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The file's header, or {} for a file that is not safetensors (it then counts as all
    layers: the loader, not the card, is where a broken file is reported)."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            return {}
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            return {}
        try:
            header = json.loads(file.read(length))
        except ValueError:
            return {}
    return header if isinstance(header, dict) else {}


def _weights_size(model_dir: Path) -> int:
    # HF cache snapshots hold symlinks into blobs/: stat follows them to the real size.
    return sum(path.stat().st_size for path in model_dir.rglob("*.safetensors"))
