"""The embedding runner's pure parts as tables: pooling over right-padded hidden states, the
batch the next forward pass takes, cutting and normalising, and the wire encodings."""

from __future__ import annotations

import base64

import mlx.core as mx
import numpy as np
import orjson
import pytest

from fleet.runner.embed_pooling import (
    EVENT_BYTES,
    batch_size,
    encode_vectors,
    finish_vectors,
    per_event,
    pool,
)
from fleet.wire.cluster import EmbeddingSpec

# Two rows, hidden size 2, padded to 3 positions; row 0 has 2 real tokens, row 1 has 3.
# The padding in row 0 holds 100s: a pooling that counted it would be far off.
HIDDEN = [
    [[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],
    [[1.0, 1.0], [2.0, 2.0], [6.0, 3.0]],
]


@pytest.mark.parametrize(
    ("how", "lengths", "expected"),
    [
        ("mean", [2, 3], [[2.0, 3.0], [3.0, 2.0]]),
        ("mean", [1, 1], [[1.0, 2.0], [1.0, 1.0]]),
        ("last", [2, 3], [[3.0, 4.0], [6.0, 3.0]]),
        ("last", [1, 2], [[1.0, 2.0], [2.0, 2.0]]),
    ],
)
def test_pooling_leaves_the_padding_out(how: str, lengths: list[int], expected: list) -> None:
    pooled = pool(mx.array(HIDDEN), lengths, how)  # type: ignore[arg-type]
    assert np.allclose(np.array(pooled), expected)


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "max_rows", "expected"),
    [
        ([3, 3, 3], 9, 8, 3),  # exactly the budget
        ([3, 3, 3], 8, 8, 2),
        ([2, 10, 2], 16, 8, 1),  # the second would pad both to 10: 20 > 16
        ([50], 16, 8, 1),  # over the budget alone still runs, alone
        ([1] * 10, 100, 4, 4),  # the row cap
        ([], 100, 4, 0),
    ],
)
def test_the_next_pass_takes_what_fits_once_padded(
    lengths: list[int], max_tokens: int, max_rows: int, expected: int
) -> None:
    assert batch_size(lengths, max_tokens, max_rows) == expected


@pytest.mark.parametrize(
    ("normalize", "dimensions", "expected"),
    [
        (True, None, [[0.6, 0.8, 0.0, 0.0]]),
        (False, None, [[3.0, 4.0, 0.0, 0.0]]),
        (True, 1, [[1.0]]),  # cut first, then normalised again
        (False, 2, [[3.0, 4.0]]),
    ],
)
def test_cut_then_normalised(normalize: bool, dimensions: int | None, expected: list) -> None:
    vectors = finish_vectors(np.array([[3.0, 4.0, 0.0, 0.0]]), normalize, dimensions)
    assert vectors.dtype == np.float32
    assert np.allclose(vectors, expected)


def test_a_zero_vector_stays_zero_when_normalised() -> None:
    assert np.array_equal(finish_vectors(np.zeros((1, 3)), True, None), np.zeros((1, 3)))


def test_base64_is_little_endian_float32_and_exact() -> None:
    vectors = np.array([[0.1, -2.5, 3.0]], dtype=np.float32)
    (encoded,) = encode_vectors(vectors, "base64")
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.array_equal(decoded, vectors[0])
    assert encode_vectors(vectors, "float") == [[float(v) for v in vectors[0]]]


@pytest.mark.parametrize(("dimensions", "encoding"), [(64, "float"), (4096, "float"),
                                                      (4096, "base64"), (200_000, "float")])
def test_an_event_stays_under_its_budget(dimensions: int, encoding: str) -> None:
    count = per_event(dimensions, encoding)  # type: ignore[arg-type]
    vectors = np.full((count, dimensions), -0.123456789, dtype=np.float32)

    size = len(orjson.dumps(encode_vectors(vectors, encoding)))  # type: ignore[arg-type]
    assert count == 1 or size <= EVENT_BYTES


@pytest.mark.parametrize(
    ("spec", "dimensions", "refused"),
    [
        (EmbeddingSpec(dimensions=64), None, False),
        (EmbeddingSpec(dimensions=64), 64, False),
        (EmbeddingSpec(dimensions=64), 16, True),  # not trained to be cut
        (EmbeddingSpec(dimensions=64, truncatable=True), 16, False),
        (EmbeddingSpec(dimensions=64, truncatable=True), 65, True),
    ],
)
def test_dimensions_only_where_the_card_allows(
    spec: EmbeddingSpec, dimensions: int | None, refused: bool
) -> None:
    assert (spec.refuses_dimensions(dimensions) is not None) == refused
