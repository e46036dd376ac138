"""One policy for every call to the broker: retry what a restart or an election can cause,
for long enough to outlast it, then fail with a typed error that names the call.

NOTES.md measured 4–8 s of "no responders" after a hard leader loss in a 3-node cluster, and
a plain restart of one server takes as long as the operator does; BROKER_BUDGET_S is the
default time a call keeps trying before it gives up. Calls that are not safe to repeat must
be made idempotent first (a Nats-Msg-Id on a JetStream publish, a revision on a KV update).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors as nats_errors
import nats.js.errors as js_errors

from fleet.errors import BrokerUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

BROKER_BUDGET_S = 30.0
FIRST_PAUSE_S = 0.1
PAUSE_CAP_S = 2.0
STORE_FULL_ERR_CODES = (10077, 10078)  # JetStream: maximum messages / bytes exceeded
# JetStream 409 "duplicate message id is in process": the first send of this Nats-Msg-Id is
# still being stored (a re-send raced it during an election); asking again gets its answer.
DUPLICATE_IN_PROCESS_ERR_CODE = 10158
# JetStream 400 "wrong last sequence" without a sequence (10164, not 10071's "wrong last
# sequence: N"): a clustered stream's leader refuses an expected-last-subject-sequence check
# while other messages of the subject are still being proposed (seen across leader changes:
# every FLEET_OUT event carries the fence check). Sent again once those are stored, it passes,
# or fails for real with 10071.
IN_FLIGHT_LAST_SEQUENCE_ERR_CODE = 10164


class StaleRead(Exception):
    """A read answered from a replica that has not yet applied a write the leader already
    holds (an R3 stream's direct get, under load or while a server was paused): asking again
    gets the current answer."""


# What a server restart, a reconnect or a leader election looks like to nats-py.
_TRANSIENT: tuple[type[BaseException], ...] = (
    StaleRead,
    nats_errors.TimeoutError,
    nats_errors.NoRespondersError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.OutboundBufferLimitError,
    nats_errors.StaleConnectionError,
    nats_errors.FlushTimeoutError,
    js_errors.ServiceUnavailableError,
    js_errors.NoStreamResponseError,  # a publish answered 503: no stream leader (an election)
    TimeoutError,
    ConnectionError,
)


def is_transient(exc: BaseException) -> bool:
    """True for errors that a retry can cure (the broker is restarting or electing)."""
    if getattr(exc, "err_code", None) in STORE_FULL_ERR_CODES:
        return False  # a full stream answers 503 too, but waiting will not empty it
    if getattr(exc, "err_code", None) in (DUPLICATE_IN_PROCESS_ERR_CODE,
                                          IN_FLIGHT_LAST_SEQUENCE_ERR_CODE):
        return True
    if isinstance(exc, _TRANSIENT):
        return True
    # JetStream answers 503 while a stream has no leader; other API errors are final.
    # (KV errors such as KeyWrongLastSequenceError are APIErrors without a `code`.)
    return isinstance(exc, js_errors.APIError) and getattr(exc, "code", None) == 503


def pause_after(attempt: int) -> float:
    """The wait before retry number `attempt` (1-based): doubling from 0.1 s, capped at 2 s."""
    return min(PAUSE_CAP_S, FIRST_PAUSE_S * 2 ** max(0, attempt - 1))


async def with_retry(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    budget_s: float = BROKER_BUDGET_S,
) -> T:
    """`await call()`, retried on transient errors until `budget_s` has passed; then
    BrokerUnavailable naming `what`. Other errors propagate at once."""
    deadline = time.monotonic() + budget_s
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            attempt += 1
            pause = pause_after(attempt)
            if time.monotonic() + pause > deadline:
                raise BrokerUnavailable(
                    f"{what}: the broker did not answer for {budget_s:.0f} s "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            if attempt == 1 or attempt % 10 == 0:
                log.warning("%s: %s, retrying (attempt %d)", what, type(exc).__name__, attempt)
            await asyncio.sleep(pause)  # a retry backoff, not synchronisation
