"""Pipe frames: 4-byte big-endian length + orjson body, byte for byte."""

from __future__ import annotations

import io

import pytest

from fleet.wire.codec import DecodeError
from fleet.wire.framing import (
    READ_BYTES,
    FrameReader,
    FrameTooLarge,
    FrameWriter,
    TruncatedFrame,
    check_ended,
    decode_command,
    decode_header,
    decode_report,
    encode_frame,
    encode_message,
    take_frames,
)
from fleet.wire.pipe import LoadModel, RunnerStatusReport, SubmitTask
from fleet.wire.runners import (
    RunnerFailed,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerWarmingUp,
)
from fleet.wire.tasks import CancelTask, TextGeneration

READY = b'{"schema_version":1,"type":"runner_status","status":{"state":"ready"}}'


def test_encode_frame_prefixes_the_big_endian_length() -> None:
    assert encode_frame(b"hello") == b"\x00\x00\x00\x05hello"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame(b"x" * 258) == b"\x00\x00\x01\x02" + b"x" * 258


def test_encode_message_is_the_orjson_body_in_a_frame() -> None:
    frame = encode_message(RunnerStatusReport(status=RunnerReady()))
    assert frame == len(READY).to_bytes(4, "big") + READY
    load = b'{"schema_version":1,"type":"load_model"}'
    assert encode_message(LoadModel()) == b"\x00\x00\x00\x28" + load


def test_decode_header_reads_the_length_and_enforces_the_cap() -> None:
    assert decode_header(b"\x00\x00\x01\x02") == 258
    with pytest.raises(FrameTooLarge, match="announces 1025 bytes"):
        decode_header(b"\x00\x00\x04\x01", max_bytes=1024)
    with pytest.raises(TruncatedFrame, match="2 of 4 header bytes"):
        decode_header(b"\x00\x00")


def test_encoding_over_the_cap_is_refused() -> None:
    with pytest.raises(FrameTooLarge, match="over the 4-byte cap"):
        encode_frame(b"12345", max_bytes=4)


def test_decoders_are_strict_about_the_message() -> None:
    assert decode_report(READY) == RunnerStatusReport(status=RunnerReady())
    assert decode_command(b'{"type":"cancel_task","task_id":"t1"}') == CancelTask(task_id="t1")
    with pytest.raises(DecodeError, match="surprise: Extra inputs"):
        decode_command(b'{"type":"load_model","surprise":1}')
    with pytest.raises(DecodeError):
        decode_report(b'{"type":"load_model"}')  # a command is not a report


def test_sync_writer_and_reader_round_trip_then_see_a_clean_end() -> None:
    pipe = io.BytesIO()
    writer = FrameWriter(pipe)
    task = TextGeneration(task_id="t1", model="fault-llm", prompt="hi")
    writer.write(SubmitTask(task=task, queue_wait_s=0.5))
    writer.write(RunnerStatusReport(status=RunnerLoading(layers_done=1, layers_total=2)))
    reader = FrameReader(io.BytesIO(pipe.getvalue()))
    assert decode_command(reader.read() or b"") == SubmitTask(task=task, queue_wait_s=0.5)
    second = decode_report(reader.read() or b"")
    assert second == RunnerStatusReport(status=RunnerLoading(layers_done=1, layers_total=2))
    assert reader.read() is None


@pytest.mark.parametrize(
    ("stream", "error"),
    [
        (b"\x00\x00", "2 of 4 header bytes"),
        (b"\x00\x00\x00\x05hel", "3 of 5 body bytes"),
        (b"\x00\x00\x00\x05hello\x00", "1 of 4 header bytes"),
    ],
)
def test_sync_reader_reports_a_truncated_stream(stream: bytes, error: str) -> None:
    reader = FrameReader(io.BytesIO(stream))
    with pytest.raises(TruncatedFrame, match=error):
        while reader.read() is not None:
            pass


def test_sync_reader_refuses_an_oversized_frame_before_reading_it() -> None:
    with pytest.raises(FrameTooLarge):
        FrameReader(io.BytesIO(b"\xff\xff\xff\xff"), max_bytes=1 << 20).read()


def _read_all(data: bytes, chunk: int = READ_BYTES) -> list[bytes]:
    """As the worker's pump reads a runner's pipe: `chunk` bytes at a time, then its end."""
    pending, bodies = bytearray(), []
    for at in range(0, len(data), chunk):
        pending += data[at : at + chunk]
        bodies += take_frames(pending)
    check_ended(pending)
    return bodies


@pytest.mark.parametrize("chunk", [1, 3, 5, READ_BYTES])  # frames split anywhere, or whole
def test_the_worker_reads_whole_frames_then_a_clean_end(chunk: int) -> None:
    stream = encode_frame(b"one") + encode_frame(b"") + encode_frame(b"3")
    assert _read_all(stream, chunk) == [b"one", b"", b"3"]


@pytest.mark.parametrize(
    ("stream", "error"),
    [(b"\x00", "1 of 4 header bytes"), (b"\x00\x00\x00\x09abc", "3 of 9 body bytes"),
     (encode_frame(b"whole") + b"\x00\x00", "2 of 4 header bytes")],
)
def test_the_worker_reports_a_truncated_stream(stream: bytes, error: str) -> None:
    with pytest.raises(TruncatedFrame, match=error):
        _read_all(stream, chunk=2)


def test_the_worker_refuses_an_oversized_frame_before_its_body() -> None:
    with pytest.raises(FrameTooLarge):
        take_frames(bytearray(b"\x00\x10\x00\x00"), max_bytes=1024)


def test_the_runners_reporter_holds_a_passs_task_reports_for_one_write() -> None:
    """Deferred (the main loop's passes), a task's reports wait in the buffer for the pass's
    flush; a status report goes at once (load progress comes from inside one long pass)."""
    from fleet.runner.main import _Reporter
    from fleet.wire.events import TaskFinished

    class Counted(io.BytesIO):
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1

    stream = Counted()
    reporter = _Reporter(FrameWriter(stream))
    reporter.deferred = True
    for i in range(3):
        reporter(TaskFinished(task_id=f"t{i}", at=1.0, status="completed"))
    assert stream.flushes == 0
    reporter(RunnerStatusReport(status=RunnerLoading(layers_total=2)))
    assert stream.flushes == 1
    reporter.flush()
    assert stream.flushes == 2
    reporter.deferred = False
    reporter(TaskFinished(task_id="t9", at=1.0, status="completed"))
    assert stream.flushes == 3


@pytest.mark.parametrize(
    ("report", "at_once"),
    [
        (RunnerStatusReport(status=RunnerLoading(layers_total=2)), True),
        (RunnerStatusReport(status=RunnerWarmingUp()), True),
        (RunnerStatusReport(status=RunnerFailed(error="boom")), True),
        # a step's end or a batch of commands: the pass's flush follows at once
        (RunnerStatusReport(status=RunnerRunning(active_tasks=3)), False),
        (RunnerStatusReport(status=RunnerReady()), False),
    ],
)
def test_which_reports_a_deferred_pass_writes_at_once(
    report: RunnerStatusReport, at_once: bool
) -> None:
    from fleet.runner.main import _written_at_once
    from fleet.wire.events import TaskFinished

    assert _written_at_once(report) is at_once
    assert not _written_at_once(TaskFinished(task_id="t", at=1.0, status="completed"))
