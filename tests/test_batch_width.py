"""The default batch width of a text runner: the engine's batch, within the node's memory."""

from __future__ import annotations

import pytest

from fleet.batch_width import (
    EMBEDDING_BATCH,
    ENGINE_BATCH,
    default_batch_width,
    kv_bytes_per_task,
)
from fleet.wire.cluster import ModelCard

GiB = 1 << 30


def card(n_layers: int = 30, hidden_size: int = 576, size_bytes: int = GiB // 2,
         tasks: tuple[str, ...] = ("text_generation",)) -> ModelCard:
    return ModelCard(id="m", name="m", tasks=list(tasks), family="mlx_lm", source="built-in",  # type: ignore[arg-type]
                     n_layers=n_layers, hidden_size=hidden_size, size_bytes=size_bytes)


@pytest.mark.parametrize(
    ("model", "free", "width"),
    [
        (card(), 16 * GiB, 29),  # SmolLM2-135M's shape on a 16 GB node: 8 clients batch at once
        (card(), 64 * GiB, ENGINE_BATCH),  # memory to spare: what the engine batches
        (card(), 2 * GiB, 2),  # little memory: fewer caches
        (card(), GiB // 4, 1),  # not even one cache's worth: still one slot
        (card(n_layers=0, hidden_size=0), 16 * GiB, ENGINE_BATCH),  # the card does not say
        (card(), 0, ENGINE_BATCH),  # the node's memory is not known
        (card(tasks=("text_to_image",)), 64 * GiB, 1),  # images run one at a time
        # embeddings keep no cache between passes: many requests share a pass, memory or not
        (card(tasks=("embeddings",)), GiB // 4, EMBEDDING_BATCH),
    ],
)
def test_default_batch_width(model: ModelCard, free: int, width: int) -> None:
    assert default_batch_width(model, free) == width


def test_a_cache_is_sized_from_the_shape() -> None:
    assert kv_bytes_per_task(card(n_layers=2, hidden_size=8)) == 2 * 2 * 8 * 4 * 2048
