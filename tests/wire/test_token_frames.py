"""The runner's token events built without a model (`token_event`) are the codec's bytes of
the TokenChunk they stand for, byte for byte.

The worker's cheap check of a runner's token event (fleet.wire.token_frames) never vouches
for a frame TokenChunk refuses: a table of malformed frames (each a typed DecodeError, never a
TokenFrame), generated frames near the token event's shape and frames with bytes changed,
checked by both; and it does vouch for every plain token event the runner's codec writes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.wire.codec import DecodeError, encode
from fleet.wire.events import TokenChunk
from fleet.wire.framing import decode_report, span_batch_body, span_batch_of
from fleet.wire.pipe import SpanBatch, TraceSpans
from fleet.wire.token_frames import (
    SpanFrame,
    TokenFrame,
    read_report,
    span_frame,
    token_event,
    token_frame,
)

GOOD: dict[str, Any] = {"schema_version": 1, "task_id": "t-1", "at": 1.5, "type": "token",
                        "index": 3, "token_id": 7, "text": "ab", "token_ids": [7, 8]}


def body(**changes: Any) -> bytes:
    event = {**GOOD, **changes}
    return orjson.dumps({k: v for k, v in event.items() if v is not DROP})


DROP = object()


def test_a_plain_token_event_is_vouched_for_with_its_bytes() -> None:
    frame = body()
    assert token_frame(frame) == TokenFrame("t-1", 3, frame)
    assert read_report(frame) == TokenFrame("t-1", 3, frame)


@pytest.mark.parametrize("frame", [
    b"not json",
    b"[1, 2]",
    body(type="tokens"),
    body(task_id="a.b"),  # not subject-safe
    body(task_id="t\n"),  # a `$` in Python's re would have let this through
    body(task_id=""),
    body(task_id="x" * 129),
    body(task_id=7),
    body(index=-1),
    body(index=True),  # a JSON bool is no int to the strict model
    body(index=1.0),
    body(token_id="7"),
    body(token_id=None),
    body(text=None),
    body(text=1),
    body(at="now"),
    body(at=False),
    body(schema_version=2),
    body(schema_version="1"),
    body(token_ids=[7]),  # several tokens are two or more
    body(token_ids=[8, 9]),  # must start with token_id
    body(token_ids=[7, "8"]),
    body(token_ids=[7, 8.0]),
    body(extra=1),
    body(index=DROP),
    body(at=DROP),
    body(text=DROP),
    body(token_ids=[7, 8], logprob=-0.5),  # several tokens carry no logprobs
    body(index=3).replace(b'"index":3', b'"index":03'),  # not JSON
    body(text="a").replace(b'"a"', b'"\\ud800"'),  # a lone surrogate
    body(text="a").replace(b'"a"', b'"\xff"'),  # not UTF-8
    body(text="a").replace(b'"a"', b'"\x01"'),  # a raw control character
    body(text="a").replace(b'"a"', b'"\\x"'),  # no such escape
])
def test_a_malformed_frame_is_a_decode_error_never_a_token_frame(frame: bytes) -> None:
    assert frame != body()
    assert token_frame(frame) is None
    with pytest.raises(DecodeError):
        read_report(frame)


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**63 - 1), st.floats(allow_nan=False),
    st.text(max_size=4), st.sampled_from(["token", "t-1", "a.b", "", "x" * 129]),
    st.lists(st.integers(0, 9), max_size=3), st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1),
                                                               st.text()), max_size=3),
)
FIELDS = [*GOOD, "logprob", "top_logprobs", "extra"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4),
       st.lists(st.sampled_from(list(GOOD)), max_size=2))
def test_the_cheap_check_never_accepts_what_the_model_refuses(
    changed: dict[str, Any], dropped: list[str]
) -> None:
    event = {**GOOD, **changed}
    for name in dropped:
        event.pop(name, None)
    frame = orjson.dumps(event)
    vouched = token_frame(frame)
    try:
        model = decode_report(frame)
    except DecodeError:
        assert vouched is None
        return
    if vouched is not None:
        assert isinstance(model, TokenChunk)
        assert (vouched.task_id, vouched.index) == (model.task_id, model.index)


@pytest.mark.parametrize("frame", [
    body().replace(b'"index":3', b'"index": 3'),  # whitespace: JSON, not the codec's
    orjson.dumps({**dict(reversed(GOOD.items()))}),  # another order
    body().replace(b'"text":"ab"', b'"text":"\\u0061b"'),  # an escape orjson never writes
])
def test_a_valid_frame_the_check_cannot_vouch_for_is_decoded_fully(frame: bytes) -> None:
    assert token_frame(frame) is None
    assert read_report(frame) == TokenFrame("t-1", 3, frame)


def ok_token(draw: Any) -> TokenChunk:
    several = draw(st.booleans())
    first = draw(st.integers(-(2**40), 2**40))
    return TokenChunk(
        task_id=draw(st.from_regex(r"[A-Za-z0-9_-]{1,128}", fullmatch=True)),
        at=draw(st.floats(allow_nan=False, allow_infinity=False)),
        index=draw(st.integers(0, 10**18 - 1)), token_id=first, text=draw(st.text(max_size=40)),
        token_ids=[first, *draw(st.lists(st.integers(-(2**40), 2**40), min_size=1,
                                         max_size=20))] if several else None,
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_plain_event_the_codec_writes_is_vouched_for(data: st.DataObject) -> None:
    event = ok_token(data.draw)
    frame = encode(event)
    assert token_frame(frame) == TokenFrame(event.task_id, event.index, frame)


@settings(max_examples=600, deadline=None)
@given(st.data(), st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3)),
                           min_size=1, max_size=3))
def test_changed_bytes_are_vouched_for_only_when_the_model_accepts_them(
    data: st.DataObject, edits: list[tuple[int, bytes]]
) -> None:
    frame = encode(ok_token(data.draw))
    for at, new in edits:
        at %= len(frame)
        frame = frame[:at] + new + frame[at + len(new) % 2:]
    vouched = token_frame(frame)
    try:
        model = decode_report(frame)
    except DecodeError:
        assert vouched is None
        return
    if vouched is not None:
        assert isinstance(model, TokenChunk)
        assert (vouched.task_id, vouched.index) == (model.task_id, model.index)


def chunk_of(task_id: str, at: float, index: int, ids: list[int], text: str) -> TokenChunk:
    return TokenChunk(task_id=task_id, at=at, index=index, token_id=ids[0], text=text,
                      token_ids=ids if len(ids) > 1 else None)


@pytest.mark.parametrize(("task_id", "at", "index", "ids", "text"), [
    ("t-1", 1.5, 0, [7], " t0"),  # one token: no token_ids, as the model leaves them out
    ("t-1", 1.5, 3, [7, 8], "ab"),
    ("A_b-9", 1_796_450_156.7308276, 10**18 - 1, [-(2**40), 0, 2**40], ""),
    ("t", 100, 1, [1, 2], "x"),  # an int time: a float, as the model stores it
    ("t", -0.0, 2, [5], 'quote " backslash \\ newline \n tab \t nul \x00 \u2028 é 字 😀'),
    ("t", 1e-7, 4, list(range(16)), "\x7f\x1f"),
])
def test_a_token_event_is_the_codecs_bytes_of_its_model(
    task_id: str, at: float, index: int, ids: list[int], text: str
) -> None:
    built = token_event(task_id, at, index, ids, text)
    assert built == encode(chunk_of(task_id, at, index, ids, text))
    assert read_report(built) == TokenFrame(task_id, index, built)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_every_token_event_is_the_codecs_bytes_of_its_model(data: st.DataObject) -> None:
    event = ok_token(data.draw)
    built = token_event(event.task_id, event.at, event.index, event.ids, event.text)
    assert built == encode(event)
    assert decode_report(built) == event


# ---- span batches: written once by the runner, split by the worker without reading a record --

TRACE_A, TRACE_B = "0af7651916cd43dd8448eb211c80319c", "1" * 32
RECORD: dict[str, Any] = {
    "trace_id": TRACE_A, "span_id": "b7ad6b7169203331",
    "name": "chat tiny-llm", "kind": "internal", "service": "fleet-runner",
    "start_ns": 1796479392552868400, "end_ns": 1796479392553868400,
    "parent_id": "b7ad6b7169203332",
    "attributes": {"gen_ai.usage.output_tokens": 1, "fleet.tokens_per_s": 812.5,
                   "fleet.stop": ("\n\n", "é😀"), "fleet.cached": False},
    "events": [{"name": "image", "time_ns": 1, "attributes": {"fleet.image.index": 0}}],
    "links": [{"trace_id": "1" * 32, "span_id": "2" * 16}],
}
PREFILL: dict[str, Any] = {"trace_id": TRACE_A, "name": "prefill", "attributes": {}}
OTHER: dict[str, Any] = {"trace_id": TRACE_B, "name": "start runner", "n": 1.5e300,
                         "s": "\u2028"}

RUNS: list[list[tuple[str, list[dict[str, Any]]]]] = [
    [],
    [(TRACE_A, [RECORD])],
    [(TRACE_A, [RECORD, PREFILL] * 3), (TRACE_B, [OTHER]), (TRACE_A, [PREFILL])],
    [(TRACE_A, [{"attributes": {"odd": b"bytes"}}])],  # no JSON value: as the model dumps it
]


def json_of(records: list[dict[str, Any]]) -> bytes:
    """The records' JSON as the codec writes them in a SpanBatch, comma-joined."""
    written = encode(SpanBatch(traces=[], spans=records))
    before = b'{"schema_version":1,"type":"spans","traces":[],"spans":['
    assert written.startswith(before) and written.endswith(b"]}")
    return written[len(before) : -2]


@pytest.mark.parametrize("runs", RUNS)
def test_a_span_batch_is_written_as_the_codec_writes_it(
    runs: list[tuple[str, list[dict[str, Any]]]],
) -> None:
    batch = span_batch_of(runs)
    model = SpanBatch(
        traces=[(t, len(records), len(json_of(records))) for t, records in runs],
        spans=[record for _, records in runs for record in records],
    )
    assert batch.model_dump() == model.model_dump()  # the fields (its frame aside)
    assert span_batch_body(batch) == encode(batch) == encode(model)
    assert decode_report(span_batch_body(batch)) == decode_report(encode(model))


@pytest.mark.parametrize("runs", RUNS)
def test_the_worker_splits_a_span_batch_into_its_runs_as_written(
    runs: list[tuple[str, list[dict[str, Any]]]],
) -> None:
    frame = span_batch_body(span_batch_of(runs))
    expected = SpanFrame([TraceSpans(t, len(records), json_of(records)) for t, records in runs])
    assert span_frame(frame) == read_report(frame) == expected
    for part, (_, records) in zip(expected.parts, runs, strict=True):  # each the records' JSON
        dumped = SpanBatch(traces=[], spans=records).model_dump(mode="json")["spans"]
        assert orjson.loads(b"[" + part.body + b"]") == dumped


def spans_frame(**changes: Any) -> bytes:
    written = orjson.loads(span_batch_body(span_batch_of(RUNS[2])))
    return orjson.dumps({k: v for k, v in {**written, **changes}.items() if v is not DROP})


def resized(frame: bytes, run: int, by: int) -> bytes:
    """`frame` with the size of its `run`-th run told wrong by `by` bytes."""
    written = orjson.loads(frame)
    written["traces"][run][2] += by
    return orjson.dumps(written)


@pytest.mark.parametrize("frame", [
    spans_frame(traces=[]),  # an index that does not add up: read fully, split by trace ids
    resized(spans_frame(), 0, -1),
    resized(spans_frame(), 1, 1),
    spans_frame(traces=[[TRACE_A, 1, 2], [TRACE_A, 1, 2]]),
    spans_frame().replace(b'"spans":[', b'"spans": ['),  # another layout
    spans_frame(schema_version=True),  # the model takes it (True == 1): read fully
])
def test_a_span_batch_that_cannot_be_split_is_read_fully_and_split_by_trace(
    frame: bytes,
) -> None:
    assert span_frame(frame) is None
    batch = decode_report(frame)
    assert isinstance(batch, SpanBatch)
    got = read_report(frame)
    assert got == SpanFrame([TraceSpans(t, len(records), json_of(records))
                             for t, records in RUNS[2]])


@pytest.mark.parametrize("frame", [
    spans_frame(schema_version=2),
    spans_frame(schema_version="1"),
    spans_frame(type="span"),
    spans_frame(spans={}),
    spans_frame(spans=[1]),
    spans_frame(spans=[[RECORD]]),
    spans_frame(spans=DROP),
    spans_frame(traces=DROP),
    spans_frame(traces=[["not-a-trace-id", 1, 2]], spans=[{}]),
    spans_frame(traces=[[TRACE_A, 0, 2]], spans=[{}]),
    spans_frame(extra=1),
    spans_frame()[:-1],  # not JSON
    b'{"schema_version":1,"type":"spans","spans":[]}',  # the layout before `traces`
])
def test_a_malformed_span_batch_is_a_decode_error(frame: bytes) -> None:
    assert span_frame(frame) is None
    with pytest.raises(DecodeError):
        read_report(frame)
