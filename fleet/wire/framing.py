"""Frames on the worker <-> runner pipe: a 4-byte big-endian length, then one orjson body.

The encoders and the header decoder are pure and tested byte for byte. The runner reads and
writes with the blocking `FrameReader` / `FrameWriter` (its stdin and stdout); the worker
writes `encode_message` frames to a runner's stdin and splits what it reads from its stdout
with `take_frames`. Errors:

    FrameError          the pipe does not carry well-formed frames
     ├── FrameTooLarge  a length over the cap (a corrupt stream, or a message that should travel
     │                  by reference: images go by sha256, never inline)
     └── TruncatedFrame the stream ended inside a frame (the other side died mid-write)

A stream that ends exactly between frames is not an error: FrameReader returns None, and
`check_ended` passes.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import BinaryIO

import orjson
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from fleet.wire.codec import decode_with, encode
from fleet.wire.pipe import COMMAND, REPORT, RunnerCommand, RunnerReport, SpanBatch

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 * 1024 * 1024


class FrameError(Exception):
    """The pipe does not carry well-formed frames."""


class FrameTooLarge(FrameError):
    pass


class TruncatedFrame(FrameError):
    pass


def encode_frame(body: bytes, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    if len(body) > max_bytes:
        raise FrameTooLarge(f"frame of {len(body)} bytes is over the {max_bytes}-byte cap")
    return HEADER.pack(len(body)) + body


def decode_header(header: bytes, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """The body length announced by a 4-byte header."""
    if len(header) != HEADER.size:
        raise TruncatedFrame(f"stream ended after {len(header)} of {HEADER.size} header bytes")
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise FrameTooLarge(f"frame announces {length} bytes, over the {max_bytes}-byte cap")
    return length


def encode_message(message: BaseModel, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    return encode_frame(encode(message), max_bytes)


def span_batch_of(runs: Sequence[tuple[str, list[dict[str, object]]]]) -> SpanBatch:
    """A runner's SpanBatch of these runs (a trace id and records of that trace), its frame
    written at once: each run's records are dumped once, and their sizes make `traces`.
    Byte for byte what `encode` writes of the batch (tests/wire/test_token_frames.py); a value
    orjson cannot write is written as the model's dump writes it."""
    bodies = [_records_json(records) for _, records in runs]
    traces = [(trace_id, len(records), len(body))
              for (trace_id, records), body in zip(runs, bodies, strict=True)]
    batch = SpanBatch.model_construct(
        traces=traces, spans=[record for _, records in runs for record in records])
    batch._written = (b'{"schema_version":1,"type":"spans","traces":' + orjson.dumps(traces)
                      + b',"spans":[' + b",".join(bodies) + b"]}")
    return batch


def _records_json(records: list[dict[str, object]]) -> bytes:
    """The records' JSON, comma-joined (a JSON array without its brackets)."""
    try:
        return orjson.dumps(records)[1:-1]
    except TypeError:  # as model_dump(mode="json") makes it (bytes as text, and such)
        return orjson.dumps(to_jsonable_python(records))[1:-1]


def span_batch_body(batch: SpanBatch) -> bytes:
    """The codec's bytes of a SpanBatch: as `span_batch_of` wrote them, else `encode`'s."""
    written: bytes | None = getattr(batch, "_written", None)  # set by span_batch_of only
    return written if written is not None else encode(batch)


def decode_command(body: bytes) -> RunnerCommand:
    return decode_with(COMMAND, body)


def decode_report(body: bytes) -> RunnerReport:
    return decode_with(REPORT, body)


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Blocking reads of whole frames from a binary stream (the runner's stdin)."""

    def __init__(self, stream: BinaryIO, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._stream = stream
        self._max_bytes = max_bytes

    def read(self) -> bytes | None:
        header = _read_exactly(self._stream, HEADER.size)
        if not header:
            return None
        length = decode_header(header, self._max_bytes)
        body = _read_exactly(self._stream, length)
        if len(body) != length:
            raise TruncatedFrame(f"stream ended after {len(body)} of {length} body bytes")
        return body


class FrameWriter:
    """Blocking writes of whole frames (the runner's stdout); safe to share between threads."""

    def __init__(self, stream: BinaryIO, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._stream = stream
        self._max_bytes = max_bytes
        self._lock = threading.Lock()

    def write(self, message: BaseModel) -> None:
        self.write_body(encode(message))

    def write_body(self, body: bytes, flush: bool = True) -> None:
        """A message already encoded (the coalescer's token events, built without a model).
        `flush` False leaves it in the stream's buffer for the next flush: the coalescer
        sends a step's token events with one write to the pipe."""
        frame = encode_frame(body, self._max_bytes)
        with self._lock:
            self._stream.write(frame)
            if flush:
                self._stream.flush()

    def flush(self) -> None:
        with self._lock:
            self._stream.flush()


READ_BYTES = 1 << 16  # the worker reads a runner's pipe this much at a time (at most)


def take_frames(pending: bytearray, max_bytes: int = MAX_FRAME_BYTES) -> list[bytes]:
    """The bodies of the whole frames at the start of `pending`, which keeps what is left
    (a frame not yet whole). The worker reads a runner's pipe in chunks and splits them here:
    a step's reports (a token and a terminal a task, 64 tasks) cost one read, not two
    readexactly calls a frame (~1.7 us a task, issue 23). Raises FrameTooLarge."""
    bodies: list[bytes] = []
    start, size = 0, len(pending)
    while size - start >= HEADER.size:
        length = decode_header(bytes(pending[start : start + HEADER.size]), max_bytes)
        end = start + HEADER.size + length
        if end > size:
            break
        bodies.append(bytes(pending[start + HEADER.size : end]))
        start = end
    del pending[:start]
    return bodies


def check_ended(pending: bytearray) -> None:
    """The stream ended with `pending` left over (after `take_frames`): between frames when
    empty; else it ended inside one (TruncatedFrame)."""
    if not pending:
        return
    if len(pending) < HEADER.size:
        raise TruncatedFrame(f"stream ended after {len(pending)} of {HEADER.size} header bytes")
    (length,) = HEADER.unpack_from(pending)
    raise TruncatedFrame(
        f"stream ended after {len(pending) - HEADER.size} of {length} body bytes"
    )
