"""The broker retry policy: which errors are retried, how long it waits, when it gives up."""

from __future__ import annotations

import nats.errors as nats_errors
import nats.js.errors as js_errors
import pytest

from fleet.bus.retry import StaleRead, is_transient, pause_after, with_retry
from fleet.errors import BrokerUnavailable


def api_error(code: int, err_code: int) -> js_errors.APIError:
    error = js_errors.ServiceUnavailableError() if code == 503 else js_errors.APIError()
    error.code, error.err_code = code, err_code
    return error


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (nats_errors.TimeoutError(), True),
        (nats_errors.NoRespondersError(), True),
        (nats_errors.ConnectionReconnectingError(), True),
        (TimeoutError(), True),
        (api_error(503, 10008), True),  # no stream leader (an election)
        (js_errors.NoStreamResponseError(), True),  # a publish during an election
        (api_error(503, 10077), False),  # the stream is full: waiting does not empty it
        (api_error(503, 10078), False),
        (api_error(404, 10059), False),
        (api_error(409, 10158), True),  # the same Nats-Msg-Id is still being stored
        (api_error(409, 10071), False),  # wrong last sequence: final
        (js_errors.KeyWrongLastSequenceError(), False),  # an APIError without a code
        (StaleRead("a replica behind its leader"), True),
        (nats_errors.ConnectionClosedError(), False),
        (ValueError("bad"), False),
    ],
)
def test_which_errors_are_retried(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


@pytest.mark.parametrize(
    ("attempt", "pause"), [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (6, 2.0), (50, 2.0)]
)
def test_pauses_double_up_to_a_cap(attempt: int, pause: float) -> None:
    assert pause_after(attempt) == pytest.approx(pause)


async def test_a_call_that_recovers_is_answered() -> None:
    answers = iter([nats_errors.NoRespondersError(), nats_errors.TimeoutError(), "ok"])

    async def call() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert await with_retry(call, what="test call", budget_s=5) == "ok"


async def test_a_call_that_never_recovers_names_itself_when_it_gives_up() -> None:
    async def call() -> None:
        raise nats_errors.NoRespondersError()

    with pytest.raises(BrokerUnavailable, match="test call"):
        await with_retry(call, what="test call", budget_s=0.5)


async def test_a_final_error_is_raised_at_once() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise api_error(503, 10077)

    with pytest.raises(js_errors.ServiceUnavailableError):
        await with_retry(call, what="full queue", budget_s=5)
    assert calls == 1


class LaggingKv:
    """A KV whose first create is refused as existing and then read back as absent, as nats-py
    reports it when the replica that answers its read is behind the leader."""

    _name = "FLEET_MODELS"
    _pre = "$KV.FLEET_MODELS."

    def __init__(self) -> None:
        self.creates = 0

    async def create(self, key: str, value: bytes) -> int:
        self.creates += 1
        if self.creates == 1:
            raise js_errors.KeyNotFoundError()
        raise js_errors.KeyWrongLastSequenceError()  # the fresh look: it exists


async def test_a_create_read_back_from_a_lagging_replica_is_asked_again() -> None:
    from fleet.bus.kv_calls import kv_create

    kv = LaggingKv()
    assert await kv_create(kv, "tiny-llm", b"{}", budget_s=5) is None  # type: ignore[arg-type]
    assert kv.creates == 2
