"""A token event goes from the runner's pipe to FLEET_OUT with the runner's bytes, never
made a TokenChunk in the worker: which reports do (a table), that those bytes are the ones
re-encoding the decoded event gave (so the wire did not change), and, against a real
nats-server, that the stream stores them as they are under the event's Nats-Msg-Id."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.client import Client

from fleet.bus.connect import connect
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import (
    EmbeddingChunk,
    ErrorChunk,
    ErrorReason,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    TopLogprob,
)
from fleet.wire.framing import decode_report
from fleet.wire.pipe import RunnerStatusReport
from fleet.wire.runners import RunnerReady
from fleet.wire.token_frames import TokenFrame, read_report, token_frame
from fleet.worker.outputs import TaskOutput, event_msg_id

AT = 1796379206.3148346  # a time as the runner writes one: every digit must survive


def token(**fields: object) -> TokenChunk:
    base: dict[str, object] = {"task_id": "t1", "at": AT, "index": 0, "token_id": 7,
                               "text": "x"}
    return TokenChunk(**{**base, **fields})  # type: ignore[arg-type]


WITH_LOGPROBS = token(logprob=-0.5, top_logprobs=[TopLogprob(token="x", token_id=7, logprob=-0.5)])


@pytest.mark.parametrize(("report", "as_written"), [
    (token(), True),
    (token(index=5, token_ids=[7, 8, 9], text="abc"), True),
    (WITH_LOGPROBS, True),  # checked by the model, still sent as written
    (TaskAccepted(task_id="t1", at=AT, model="m", node_id="n", runner_id="r"), False),
    (ToolCallChunk(task_id="t1", at=AT, index=0, id="c", name="f", arguments="{}"), False),
    (EmbeddingChunk(task_id="t1", at=AT, index=0, encoding_format="float",
                    embeddings=[[0.5]], dimensions=1, forward_pass=1), False),
    (ErrorChunk(task_id="t1", at=AT, reason=ErrorReason.INTERNAL, message="m"), False),
    (TaskFinished(task_id="t1", at=AT, status="completed"), False),
    (RunnerStatusReport(status=RunnerReady()), False),
])
def test_which_reports_are_published_as_written(report: Any, as_written: bool) -> None:
    """A token event reaches the worker's loop as its bytes (TokenFrame), every other report
    as its model."""
    frame = encode(report)
    read = read_report(frame)
    if as_written:
        assert read == TokenFrame(report.task_id, report.index, frame)
    else:
        assert read == report


@pytest.mark.parametrize(("event", "vouched"), [
    (token(), True),
    (token(index=5, token_ids=[7, 8, 9], text="abc"), True),
    (token(schema_version=1, at=12), True),
    (WITH_LOGPROBS, False),  # left to the model
])
def test_the_cheap_check_vouches_for_plain_token_events(event: TokenChunk, vouched: bool) -> None:
    assert (token_frame(encode(event)) is not None) is vouched


@pytest.mark.parametrize("event", [
    token(),
    token(index=2**40, token_id=0, text=""),
    token(index=3, token_ids=[7, 8, 9, 10], text="several tokens"),
    token(text='quotes " and \\ backslashes\n\ttabs \u0000 control'),
    token(text="non-ASCII: é ß 中文 🚀 and a combining e\u0301"),
    token(at=0.1 + 0.2),  # a float whose shortest form is long
    token(at=1e-7),
    token(logprob=-0.123456789012345, top_logprobs=[
        TopLogprob(token="x", token_id=7, logprob=-0.1),
        TopLogprob(token="y", token_id=8, logprob=-2.5e-10),
    ]),
])
def test_the_runners_bytes_are_the_bytes_re_encoding_gave(event: TokenChunk) -> None:
    """What the worker published before (its own encode of the decoded frame) equals the
    frame it publishes now: the wire is unchanged."""
    frame = encode(event)  # what the runner's FrameWriter writes
    decoded = decode_report(frame)
    assert decoded == event
    assert encode(decoded) == frame


async def test_a_frame_is_stored_as_written_under_its_events_msg_id(
    nats_url: str, provisioned_nc: Client,  # the streams in place; the test's own client
) -> None:
    nc = await connect(nats_url, "test-frames")
    output = TaskOutput(nc, nc.jetstream())
    events = [token(), token(index=1, token_id=8, token_ids=[8, 9], text="yz é")]
    frames = [encode(event) for event in events]
    for event, frame in zip(events, frames, strict=True):
        await output.chunk(TokenFrame(event.task_id, event.index, frame))
    await output.finish(TaskFinished(task_id="t1", at=AT, status="completed"))
    sub = await nc.jetstream().subscribe(subjects.out("t1"), ordered_consumer=True)
    stored = [await sub.next_msg(timeout=10) for _ in range(3)]
    await sub.unsubscribe()
    assert [m.data for m in stored[:2]] == frames
    assert [m.headers["Nats-Msg-Id"] for m in stored[:2] if m.headers] == [
        event_msg_id(event) for event in events
    ]
    assert stored[2].data == encode(TaskFinished(task_id="t1", at=AT, status="completed"))
    await nc.close()
