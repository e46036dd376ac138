"""The pure parts of the embedding runner: which queued inputs share the next forward pass,
how a padded batch's hidden states become one vector per text, and how vectors are cut to
fewer dimensions and split into events that fit a NATS message.

A batch is right-padded: the models are causal, so a real token never attends to the padding
after it, and its hidden state is the one it would have alone. Pooling only has to leave the
padding out.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Literal

import mlx.core as mx
import numpy as np

Pooling = Literal["mean", "last"]
Encoding = Literal["float", "base64"]

# An event's vectors stay under this many bytes of JSON: a quarter of NATS's default 1 MiB
# max_payload leaves room for headers and for servers configured smaller.
EVENT_BYTES = 256 * 1024
FLOAT_JSON_BYTES = 24  # a float32 printed as a JSON number, with its comma, at worst
_TINY = 1e-12


def batch_size(lengths: Sequence[int], max_tokens: int, max_rows: int) -> int:
    """How many of the queued inputs (in order) go into the next forward pass: as many as
    fit `max_tokens` once padded to the longest of them, at most `max_rows`, and always the
    first one (a single input over the budget still runs, alone)."""
    count, longest = 0, 0
    for length in lengths[:max_rows]:
        widest = max(longest, length)
        if count and (count + 1) * widest > max_tokens:
            break
        count, longest = count + 1, widest
    return count


def pool(hidden: mx.array, lengths: Sequence[int], how: Pooling) -> mx.array:
    """One vector per row of right-padded hidden states [batch, length, hidden]: the mean
    over each row's first `lengths[i]` positions, or the state at its last real position."""
    rows, width, _ = hidden.shape
    counts = mx.array(list(lengths), dtype=mx.int32)
    if how == "last":
        return hidden[mx.arange(rows), counts - 1]
    real = (mx.arange(width)[None, :] < counts[:, None]).astype(hidden.dtype)
    summed = (hidden * real[:, :, None]).sum(axis=1)
    return summed / counts[:, None].astype(hidden.dtype)


def finish_vectors(vectors: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Cut to `dimensions` (None: keep all), then scale each row to unit length if asked.
    Cutting comes first: a cut vector is normalised again, as Matryoshka models expect."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, _TINY)
    return vectors.astype(np.float32)


def encode_vectors(vectors: np.ndarray, encoding: Encoding) -> list[list[float]] | list[str]:
    """JSON numbers, or base64 of little-endian float32 (what OpenAI's base64 format is)."""
    if encoding == "base64":
        little = vectors.astype("<f4")
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    return vectors.tolist()


def per_event(dimensions: int, encoding: Encoding, budget: int = EVENT_BYTES) -> int:
    """How many vectors one event carries so that it stays under `budget` bytes."""
    each = dimensions * 4 * 4 // 3 + 4 if encoding == "base64" else dimensions * FLOAT_JSON_BYTES
    return max(1, budget // each)
