"""The pure rules of batch jobs and idempotent submission, as tables."""

from __future__ import annotations

import json

import orjson
import pytest

from fleet.gateway.batch_lines import (
    MAX_LINES,
    counts,
    final_status,
    openai_batch,
    parse_input,
    split_files,
    task_id_of,
)
from fleet.gateway.batch_runner import may_take
from fleet.gateway.batch_slack import lines_to_feed
from fleet.gateway.idempotency import fingerprint, new_id, record_key
from fleet.gateway.idempotency_seed import SEED
from fleet.wire.batches import BatchLease, BatchRecord, BatchResult, RequestCounts

CHAT = "/v1/chat/completions"


def line(custom_id: object = "a", method: str = "POST", url: str = CHAT,
         body: object = None) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": "m"} if body is None else body}).encode()


@pytest.mark.parametrize(("data", "lines", "codes"), [
    (line("a") + b"\n" + line("b"), ["a", "b"], []),
    (line("a") + b"\n\n  \n" + line("b") + b"\n", ["a", "b"], []),  # blank lines are skipped
    (b"", [], ["empty_file"]),
    (b"{not json", [], ["invalid_json_line"]),
    (b"[1, 2]", [], ["invalid_request"]),
    (line(custom_id=""), [], ["missing_required_parameter"]),
    (line(custom_id=7), [], ["missing_required_parameter"]),
    (line("a") + b"\n" + line("a"), ["a"], ["duplicate_custom_id"]),
    (line(method="GET"), [], ["invalid_method"]),
    (line(url="/v1/completions"), [], ["mismatched_endpoint"]),
    (line(body=[1]), [], ["invalid_request"]),
])
def test_input_lines(data: bytes, lines: list[str], codes: list[str]) -> None:
    parsed, errors = parse_input(data, CHAT)
    assert [p.custom_id for p in parsed] == lines
    assert [e.code for e in errors] == codes
    assert [p.line for p in parsed] == list(range(len(parsed)))


def test_an_error_names_its_line_in_the_file() -> None:
    _, errors = parse_input(line("a") + b"\n\nnope\n", CHAT)
    assert [(e.code, e.line) for e in errors] == [("invalid_json_line", 2)]


def test_too_many_lines_fail_the_job() -> None:
    data = b"\n".join(line(str(i)) for i in range(MAX_LINES + 1))
    assert [e.code for e in parse_input(data, CHAT)[1]] == ["too_many_requests"]


def result(index: int, status: int) -> BatchResult:
    return BatchResult(batch_id="batch_x", line=index, custom_id=f"c{index}",
                       task_id=task_id_of("batch_x", index), status_code=status,
                       body={"ok": index})


def test_output_and_error_files_in_line_order() -> None:
    output, errors = split_files([result(2, 200), result(0, 200), result(1, 400)])
    out = [orjson.loads(x) for x in output.splitlines()]
    assert [x["custom_id"] for x in out] == ["c0", "c2"]
    assert out[0] == {"id": "batch_req_batch_x-0", "custom_id": "c0", "error": None,
                      "response": {"status_code": 200, "request_id": "batch_x-0",
                                   "body": {"ok": 0}}}
    assert [orjson.loads(x)["custom_id"] for x in errors.splitlines()] == ["c1"]
    assert split_files([]) == (b"", b"")


def test_counts() -> None:
    assert counts(5, [result(0, 200), result(1, 500), result(2, 200)]) == RequestCounts(
        total=5, completed=2, failed=1)


def record(status: str, total: int = 3, expires_at: int = 1000) -> BatchRecord:
    return BatchRecord(id="batch_x", endpoint=CHAT, input_file_id="file-x", status=status,
                       created_at=0, expires_at=expires_at,
                       request_counts=RequestCounts(total=total))


@pytest.mark.parametrize(("status", "recorded", "now", "final"), [
    ("in_progress", 3, 10, "completed"),
    ("in_progress", 2, 10, None),  # lines still to record: the next holder goes on
    ("in_progress", 2, 1000, "expired"),
    ("in_progress", 3, 1000, "completed"),  # everything done beats a closed window
    ("cancelling", 1, 10, "cancelled"),
    ("cancelling", 3, 1000, "cancelled"),
])
def test_final_status(status: str, recorded: int, now: float, final: str | None) -> None:
    assert final_status(record(status), recorded, now) == final


@pytest.mark.parametrize(("lease", "now", "takes"), [
    (None, 5.0, True),
    (BatchLease(batch_id="b", owner="me", until=10.0), 5.0, True),  # renewing our own
    (BatchLease(batch_id="b", owner="other", until=10.0), 5.0, False),
    (BatchLease(batch_id="b", owner="other", until=10.0), 10.0, True),  # lapsed
])
def test_who_may_take_a_lease(lease: BatchLease | None, now: float, takes: bool) -> None:
    assert may_take(lease, "me", now) is takes


def test_the_batch_object_is_openais() -> None:
    body = openai_batch(record("in_progress"))
    assert body["object"] == "batch" and body["errors"] is None
    assert {"type", "schema_version", "tenant"}.isdisjoint(body)
    assert body["request_counts"] == {"total": 3, "completed": 0, "failed": 0}


@pytest.mark.parametrize(("a", "b", "same"), [
    (("/v1/chat/completions", "application/json", b"{}"),
     ("/v1/chat/completions", "application/json", b"{}"), True),
    (("/v1/chat/completions", "application/json", b"{}"),
     ("/v1/chat/completions", "application/json", b"{ }"), False),
    (("/v1/chat/completions", "application/json", b"{}"),
     ("/v1/completions", "application/json", b"{}"), False),
    # a multipart body's boundary changes from one send to the next: the path decides
    (("/v1/files", "multipart/form-data; boundary=a", b"--a"),
     ("/v1/files", "multipart/form-data; boundary=b", b"--b"), True),
])
def test_what_a_retry_must_repeat(a: tuple[str, str, bytes], b: tuple[str, str, bytes],
                                  same: bool) -> None:
    assert (fingerprint(*a) == fingerprint(*b)) is same


def test_keys_are_per_tenant_and_ids_follow_the_seed() -> None:
    assert record_key("t1", "k") != record_key("t2", "k")
    assert record_key(None, "k").startswith("_.")
    token = SEED.set("seed1234")
    try:
        assert (new_id("batch"), new_id("file")) == ("batch_seed1234", "file-seed1234")
    finally:
        SEED.reset(token)
    assert new_id("batch") != new_id("batch")


@pytest.mark.parametrize(("waiting", "since_fed_s", "lines"), [
    (0, 0.0, 16),  # the queue is drained: fill it up to the low water
    (15, 0.0, 1),
    (16, 0.0, 0),  # every slot busy and lines waiting: the job waits
    (40, 29.9, 0),
    (40, 30.0, 1),  # starvation bound: one line after 30 s without feeding
    (16, 31.0, 1),
])
def test_batch_work_fills_slack(waiting: int, since_fed_s: float, lines: int) -> None:
    assert lines_to_feed(waiting, since_fed_s) == lines
