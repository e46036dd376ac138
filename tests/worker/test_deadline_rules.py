"""The pure parts of deadlines in the broker (fleet.bus.deadlines), as tables."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from fleet.bus.deadlines import (
    TAKEOVER_GRACE_S,
    deadline_subject,
    expires,
    task_of,
    task_ttl_header,
    ttl_header,
    ttl_seconds,
)

NOW = 1_000.0


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@pytest.mark.parametrize(("deadline", "ttl"), [
    (None, None),
    (at(NOW + 10), 10),
    (at(NOW + 9.2), 10),  # rounded up: never expired before its deadline
    (at(NOW + 0.3), 1),  # the broker's TTLs are whole seconds, at least one
    (at(NOW - 5), 1),  # already past: expires at once
])
def test_the_sentinel_ttl_ends_at_the_deadline(deadline: datetime | None, ttl: int | None) -> None:
    assert ttl_seconds(deadline, NOW) == ttl
    assert ttl_header(deadline, NOW) == ({} if ttl is None else {"Nats-TTL": f"{ttl}s"})


@pytest.mark.parametrize(("deadline", "grace", "header"), [
    (None, 300, {}),
    (at(NOW + 10), 300, {"Nats-TTL": "310s"}),  # the sentinel at 10 s, the message 5 min later
    (at(NOW + 9.2), 60, {"Nats-TTL": "70s"}),
    (at(NOW - 5), 0, {"Nats-TTL": "1s"}),
])
def test_the_task_message_outlives_its_deadline_by_the_grace(
    deadline: datetime | None, grace: int, header: dict[str, str]
) -> None:
    """So that a worker lost after the task started is still taken over (issue 25)."""
    assert task_ttl_header(deadline, NOW, grace) == header
    assert TAKEOVER_GRACE_S >= 60  # AckWait (2 s; 30 s in tests) and a takeover, with room


@pytest.mark.parametrize(("headers", "marker"), [
    (None, False),
    ({"Nats-TTL": "10s"}, False),  # the sentinel itself
    ({"Nats-Marker-Reason": "MaxAge", "Nats-TTL": "1m0s"}, True),
    ({"Nats-Marker-Reason": "Purge"}, False),  # an operator's purge is no deadline
    ({"Nats-Marker-Reason": "Remove"}, False),
])
def test_only_an_expiry_marker_expires_a_task(headers: dict[str, str] | None,
                                              marker: bool) -> None:
    assert expires(headers) is marker


def test_the_sentinel_names_its_task() -> None:
    subject = deadline_subject("smollm2-135m", "chat-1_x")
    assert subject == "fleet.deadlines.smollm2-135m.chat-1_x"
    assert task_of(subject) == "chat-1_x"
