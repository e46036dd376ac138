"""Permission violations the server reports to this process, and calls that fail on them.

A publish the server refuses by permission gets no reply: nats-py hears of it only through
its error callback (`-ERR 'Permissions Violation for Publish to "..."'`) while the publish
waits out its timeout, which the retry policy would take for an election's silence and
repeat for its whole budget. `refused_by_permission` races a call against a denial of its
subject, so a misconfigured role fails at once with a typed error naming the subject.

The record is per process (a health check reads it: `permission_errors`); nats-py lowers the
case of the server's error text, so subjects compare without case.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fleet.errors import NotPermitted

T = TypeVar("T")

# How long a permission violation keeps a health check from saying "ok".
PERMISSION_WINDOW_S = 60.0
_PERMISSION = re.compile(r"permissions violation for (\w+) to \"?([^\"\s']+)\"?", re.IGNORECASE)


@dataclass(frozen=True)
class PermissionDenied:
    """One permission violation the server reported to this process."""

    operation: str  # "publish" | "subscription"
    subject: str
    at: float  # time.time()


_denied: deque[PermissionDenied] = deque(maxlen=100)
_waiting: dict[str, set[asyncio.Future[PermissionDenied]]] = {}  # lowered subject -> waiters


def parse_permission_error(message: str) -> PermissionDenied | None:
    if match := _PERMISSION.search(message):
        return PermissionDenied(match.group(1).lower(), match.group(2), time.time())
    return None


def record(denied: PermissionDenied) -> None:
    """Keep a violation for the health check and fail the calls waiting on its subject."""
    _denied.append(denied)
    for waiter in _waiting.get(denied.subject.lower(), ()):
        if not waiter.done():
            waiter.set_result(denied)


def permission_errors(within_s: float = PERMISSION_WINDOW_S) -> list[PermissionDenied]:
    """The permission violations of this process in the last `within_s` seconds, oldest
    first: a health check is not ok while this is non-empty."""
    since = time.time() - within_s
    return [denied for denied in _denied if denied.at >= since]


def forget_permission_errors() -> None:
    """For tests that share one process between roles."""
    _denied.clear()


async def refused_by_permission(call: Callable[[], Awaitable[T]], subject: str) -> T:
    """`await call()`, unless the server refuses a publish to `subject` meanwhile: then
    NotPermitted at once (the call is cancelled; it would only time out)."""
    key = subject.lower()
    denial: asyncio.Future[PermissionDenied] = asyncio.get_running_loop().create_future()
    _waiting.setdefault(key, set()).add(denial)
    # Owned here, never left behind: its result or error is the caller's, and on a denial (or
    # the caller's cancel) it is cancelled and awaited before this returns.
    attempt = asyncio.ensure_future(call())
    try:
        await asyncio.wait({attempt, denial}, return_when=asyncio.FIRST_COMPLETED)
        if attempt.done():
            return attempt.result()
        denied = denial.result()
        raise NotPermitted(
            f"the server refused this process's {denied.operation} to {denied.subject}: its "
            "NATS user lacks that permission (docs/permissions.md)"
        )
    finally:
        denial.cancel()
        waiters = _waiting.get(key)
        if waiters is not None:
            waiters.discard(denial)
            if not waiters:
                del _waiting[key]
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
