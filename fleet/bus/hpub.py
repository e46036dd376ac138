"""A header-carrying publish whose bytes Fleet encodes itself (issue 23).

nats-py's `publish` encodes the headers on every call: each key matched against the token
pattern, each value stripped and cleaned, both encoded, then the HPUB line; ~5.9 us for the four
headers of a task's event (timeit, LOADED, 2026-12-05), three events a task. A task's output
events share all but one header (the fence's pair, made once a task; the trace context,
one a span), so `header_block` is built from lines encoded once and the one line that changes
(Nats-Msg-Id): ~0.4 us. `publish_command` hands the finished command to the connection the
way `publish` does, with the checks `publish` makes before it, so a caller sees the same
errors (closed, draining, outbound buffer full while reconnecting, payload too big).

It reaches into nats-py's Client (`_send_command`, `_flush_queue`, `_flush_pending`,
`_pending_data_size`, `_max_pending_size`, `_max_payload`): nats-py is pinned (pyproject.toml),
and tests/bus/test_hpub.py publishes through it to a real server and checks the headers a
subscriber reads, so an upgrade that moves them fails there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import nats.errors as nats_errors
from nats.aio.client import Client

HEADER_START = b"NATS/1.0\r\n"
_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token: what NATS header keys are
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})  # a value's line breaks would end the block


def header_lines(headers: Mapping[str, str]) -> bytes:
    """Pure. `Key: value\\r\\n` for each header, as a NATS header block holds them: a value
    trimmed and its line breaks made spaces (nothing can end the block early); a key that
    is not a token is refused (ValueError), as nats-py refuses it."""
    lines = []
    for key, value in headers.items():
        key = key.strip()
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a header key: {key!r}")
        lines.append(f"{key}: {value.strip().translate(_NEWLINES)}\r\n")
    return "".join(lines).encode()


def header_block(*lines: bytes) -> bytes:
    """Pure. The whole header block of a message from lines made by `header_lines`."""
    return HEADER_START + b"".join(lines) + b"\r\n"


def hpub_command(subject: str, reply: str, headers: bytes, payload: bytes) -> bytes:
    """Pure. The protocol's HPUB for `payload` with the header block `headers`."""
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
        subject.encode(), reply.encode(), len(headers), len(headers) + len(payload), headers,
        payload,
    )


async def publish_command(nc: Client, command: bytes, payload_size: int) -> None:
    """Send an encoded PUB/HPUB as `nc.publish` would have sent its own (queued behind what
    is pending, flushed by the client's flusher); `payload_size` is the message's payload,
    headers excluded, as `publish` checks and counts it."""
    if nc.is_closed:
        raise nats_errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats_errors.ConnectionDrainingError
    if not nc.is_connected and (
        nc._max_pending_size <= 0
        or payload_size + nc._pending_data_size > nc._max_pending_size
    ):
        raise nats_errors.OutboundBufferLimitError  # no buffering, or the buffer is full
    if payload_size > nc._max_payload:
        raise nats_errors.MaxPayloadError
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += payload_size
    await nc._send_command(command)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
