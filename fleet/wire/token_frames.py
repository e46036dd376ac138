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
from fleet.wire.framing import decode_report, span_batch_body, span_batch_of
from fleet.wire.pipe import RunnerReport, SpanBatch, TraceSpans

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


def read_report(body: bytes) -> RunnerReport | TokenFrame | SpanFrame:
    """A runner's report: a token event as a TokenFrame (checked cheaply, or fully when the
    cheap check cannot vouch for it), a span batch as a SpanFrame (split by its index, or
    decoded fully when that cannot be done), every other report decoded strictly. Raises
    DecodeError for a frame that is not a valid report."""
    if (frame := token_frame(body)) is not None:
        return frame
    if body.startswith(_SPANS) and (spans := span_frame(body)) is not None:
        return spans
    report = decode_report(body)
    if isinstance(report, SpanBatch):
        return runs_of(report)
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


class SpanFrame(NamedTuple):
    """A runner's SpanBatch as the worker carries it: each run of one trace's records as the
    bytes the runner wrote (TraceSpans), none of them parsed."""

    parts: list[TraceSpans]


_SPANS = b'{"schema_version":1,"type":"spans","traces":'  # as span_batch_of writes one
_SPANS_AT = b'],"spans":['  # the index's end: nothing inside the index reads so
_RUN = rb'\["[0-9a-f]{32}",[1-9][0-9]{0,8},[1-9][0-9]{0,8}\]'  # (trace id, records, bytes)
_INDEX = re.compile(rb"\[(?:" + _RUN + rb"(?:," + _RUN + rb")*)?\]")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_OPEN, _CLOSE, _COMMA = ord("{"), ord("}"), ord(",")


def span_frame(body: bytes) -> SpanFrame | None:
    """A span batch, split into its runs by its `traces` index alone, where `body` has the
    layout `span_batch_of` writes, the index is written so too (one pattern: each run's
    trace id a subject-safe 32 hex digits, its counts positive integers) and it adds up:
    each run starts `{` and ends `}` where the sizes say, and the runs (comma-joined) fill
    `spans` exactly. None for anything else, left to `read_report`'s full decode.

    The records themselves are not read: a runner's span records are its own telemetry,
    passed on as it wrote them, and a record it wrote wrong costs only its trace's message
    (`fleet trace` skips one that is not JSON). What the worker does act on (the trace id it
    holds and publishes the run under, and the split) is checked. A batch of 64 text tasks'
    runs (192 records): 343-375 us read with orjson and checked before, 71 us split now
    (timeit, min of 5, on a loaded machine, 2026-12-05)."""
    end = len(body) - 2
    if not body.startswith(_SPANS) or not body.endswith(b"]}"):
        return None
    at = body.find(_SPANS_AT, len(_SPANS))
    if at < 0 or _INDEX.fullmatch(body, len(_SPANS), at + 1) is None:
        return None
    parts: list[TraceSpans] = []
    start = at + len(_SPANS_AT)
    for trace_id, count, size in orjson.loads(body[len(_SPANS) : at + 1]):  # as matched
        stop = start + size
        if (stop > end or body[start] != _OPEN or body[stop - 1] != _CLOSE
                or (stop < end and body[stop] != _COMMA)):
            return None
        parts.append(TraceSpans(trace_id, count, body[start:stop]))
        start = stop + 1
    return SpanFrame(parts) if start == (end + 1 if parts else end) else None


def runs_of(batch: SpanBatch) -> SpanFrame:
    """A SpanBatch read fully (one `span_frame` could not split) as the worker carries it:
    its records in runs by their own trace ids (its `traces` index is the split's, not
    needed here); a record without a trace id is no span of any trace and left out."""
    runs: list[tuple[str, list[dict[str, object]]]] = []
    for record in batch.spans:
        trace_id = record.get("trace_id")
        if type(trace_id) is not str or not _TRACE_ID.fullmatch(trace_id):
            continue
        if runs and runs[-1][0] == trace_id:
            runs[-1][1].append(record)
        else:
            runs.append((trace_id, [record]))
    written = span_frame(span_batch_body(span_batch_of(runs)))
    assert written is not None, "span_batch_of writes what span_frame splits"
    return written


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


__all__ = ["SpanFrame", "TokenFrame", "read_report", "span_frame", "token_event", "token_frame"]
