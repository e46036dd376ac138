"""A runner's token event as the worker carries it: the bytes the runner wrote, with the task
id and first index the worker needs (its Nats-Msg-Id and subject, its span, its first-output
mark), and no TokenChunk built. The worker publishes those bytes unchanged
(fleet.worker.outputs), so on the token path it never needs the model.

The contract stays checked, by one regular expression over the frame: the runner writes each
event with the codec (orjson of a TokenChunk, its fields in declared order, compact), and
`token_frame` vouches only for that exact shape, each value of the type and in the range
TokenChunk declares: a subject-safe task id, integers without leading zeros (at most 18
digits), a JSON number for `at`, a JSON string for `text` (only the escapes orjson writes;
the bytes valid UTF-8), `token_ids` of two or more starting with `token_id`, no logprobs.
Anything else (logprobs, whitespace, another order, a wrong type, not JSON) is left to the full
strict decode (`read_report`), which turns a malformed frame into a DecodeError as before:
never published. Tests feed both checks the same mutated and generated frames: this one never
accepts a frame the model refuses (tests/wire/test_token_frames.py).

Cost per 16-token event, in-process (timeit, min of 10): the model's decode 3.3 us, this 2.5 us
(an orjson parse alone is 0.9; the type checks of a parsed dict in Python cost more than
pydantic-core's whole validation, so a dict walk gained nothing).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

import orjson

from fleet.wire.base import SCHEMA_VERSION
from fleet.wire.events import TokenChunk
from fleet.wire.framing import decode_report
from fleet.wire.pipe import RunnerReport, SpanBatch

_INT = r"(?:0|[1-9][0-9]{0,17})"  # JSON's integers, no leading zero, within int64
_SIGNED = "-?" + _INT
_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"  # JSON's; a float field's
_CHARS = r'[^"\\\x00-\x1f]*+'  # a JSON string's plain characters
_STRING = _CHARS + r'(?:(?:\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])' + _CHARS + ")*+"
_TOKEN_EVENT = re.compile(
    r'\{"schema_version":1,"task_id":"([A-Za-z0-9_-]{1,128})","at":' + _NUMBER
    + r',"type":"token","index":(' + _INT + r'),"token_id":(' + _SIGNED + r'),"text":"'
    + _STRING + r'"(?:,"token_ids":\[(' + _SIGNED + r")(?:," + _SIGNED + r")++\])?\}"
)


class TokenFrame(NamedTuple):
    """A token event of one or several tokens, as its runner wrote it (`body`, JSON of a
    TokenChunk). A NamedTuple: one is made per event, and a frozen dataclass costs ~4x."""

    task_id: str
    index: int
    body: bytes
    type: str = "token"  # what the worker's logs and Nats-Msg-Id call the event


def read_report(body: bytes) -> RunnerReport | TokenFrame:
    """A runner's report: a token event as a TokenFrame (checked cheaply, or fully when the
    cheap check cannot vouch for it), every other report decoded strictly. Raises DecodeError
    for a frame that is not a valid report."""
    if (frame := token_frame(body)) is not None:
        return frame
    if body.startswith(_SPANS) and (batch := span_batch(body)) is not None:
        return batch
    report = decode_report(body)
    if isinstance(report, TokenChunk):  # with logprobs: checked by the model, sent as written
        return TokenFrame(report.task_id, report.index, body)
    return report


def token_frame(body: bytes) -> TokenFrame | None:
    """A TokenFrame when `body` is a token event without logprobs, written as the codec
    writes one, that TokenChunk accepts; None for anything else."""
    if b',"type":"token",' not in body:  # the pattern's own bytes: other reports skip it
        return None
    try:
        text = body.decode()  # strict UTF-8, as the model's JSON parser
    except UnicodeDecodeError:
        return None
    if (match := _TOKEN_EVENT.fullmatch(text)) is None:
        return None
    task_id, index, token_id, first = match.groups()
    if first is not None and first != token_id:  # canonical integers: equal as text
        return None
    return TokenFrame(task_id, int(index), body)


_SPANS = b'{"schema_version":1,"type":"spans",'  # how the runner writes one (span_batch_body)
_SPAN_BATCH_KEYS = {"schema_version", "type", "spans"}
# Digits enough for an integer past orjson's (u64, i64); in a string too, which costs only
# the full decode.
_BEYOND_64_BITS = re.compile(rb"[0-9]{20}|-[0-9]{19}")


def span_batch(body: bytes) -> SpanBatch | None:
    """The SpanBatch of `body` when it is one that the model accepts, checked without the
    model's validation; None for anything else (left to `decode_report`).

    Strict validation of `list[dict[str, object]]` asks no more than this: a JSON object of
    exactly these keys, `schema_version` the integer 1, `type` "spans", and `spans` a list of
    objects (whose keys JSON makes strings, and whose values `object` takes as they are).
    A step that ends 64 text tasks sends ~192 records: 197 -> ~110 us for 64 (timeit,
    2026-12-05), most of it orjson's parse."""
    if _BEYOND_64_BITS.search(body):
        return None  # orjson reads such an integer as a float, the model as it is
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not (
        type(obj) is dict and obj.keys() == _SPAN_BATCH_KEYS
        and type(obj["schema_version"]) is int and obj["schema_version"] == SCHEMA_VERSION
        and obj["type"] == "spans" and type(spans := obj["spans"]) is list
        and all(type(record) is dict for record in spans)
    ):
        return None
    return SpanBatch.model_construct(spans=spans)


def token_event(task_id: str, at: float, index: int, token_ids: Sequence[int], text: str) -> bytes:
    """The codec's bytes of the TokenChunk of these tokens (`token_ids` only when several),
    without building the model: the runner's coalescer writes one of these per token event.

    Byte for byte what `encode(TokenChunk(...))` writes, the model's field order included
    (tests/wire/test_token_frames.py compares them); the values are not validated here: they
    come from the runner's own engines, and the worker checks every frame it reads
    (`read_report`). Cost per 7-token event, in-process: 0.3 us, against 6.8 us for a
    TokenChunk of them and the model's encode (2026-12-05)."""
    event: dict[str, object] = {
        "schema_version": SCHEMA_VERSION, "task_id": task_id, "at": float(at), "type": "token",
        "index": index, "token_id": token_ids[0], "text": text,
    }
    if len(token_ids) > 1:
        event["token_ids"] = list(token_ids)
    return orjson.dumps(event)


__all__ = ["TokenFrame", "read_report", "span_batch", "token_event", "token_frame"]
