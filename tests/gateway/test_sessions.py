"""Where a request's session id comes from (fleet.gateway.sessions): a table."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from fleet.errors import InvalidParameter
from fleet.gateway.sessions import MAX_SESSION_CHARS, session_of

CASES = [
    # (headers, body fields, session)
    ({}, {}, None),
    ({"X-Session-Id": "s1"}, {}, "s1"),
    ({"x-session-id": " s1 "}, {}, "s1"),  # surrounding blanks are not part of it
    ({"X-Session-Id": "hdr"}, {"prompt_cache_key": "key", "user": "u"}, "hdr"),
    ({}, {"prompt_cache_key": "key", "user": "u"}, "key"),
    ({}, {"prompt_cache_key": None, "user": "u"}, "u"),
    ({}, {"prompt_cache_key": "  ", "user": "u"}, "u"),  # blank: absent
    ({"X-Session-Id": ""}, {"metadata.user_id": "claude-session"}, "claude-session"),
    ({}, {"user": 42}, None),  # not text: not a session
    ({}, {"user": "x" * MAX_SESSION_CHARS}, "x" * MAX_SESSION_CHARS),
]


@pytest.mark.parametrize(("headers", "fields", "expected"), CASES)
def test_the_session_of_a_request(
    headers: dict[str, str], fields: dict[str, object], expected: str | None,
) -> None:
    assert session_of(Headers(headers), fields) == expected


@pytest.mark.parametrize(
    ("headers", "fields", "param"),
    [
        ({"X-Session-Id": "x" * (MAX_SESSION_CHARS + 1)}, {}, "x-session-id"),
        ({}, {"metadata.user_id": "x" * (MAX_SESSION_CHARS + 1)}, "metadata.user_id"),
    ],
)
def test_a_session_id_too_long_is_refused_naming_its_place(
    headers: dict[str, str], fields: dict[str, object], param: str,
) -> None:
    with pytest.raises(InvalidParameter) as refused:
        session_of(Headers(headers), fields)
    assert refused.value.param == param
